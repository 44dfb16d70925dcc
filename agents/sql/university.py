"""A small university database, generated here from a fixed seed.

A second domain beside Chinook, so that the agent reads a schema instead of memorising one:
departments, their instructors and courses, students (each with a major) and enrollments with
a numeric score. Names come from fixed lists; everything random comes from `Random.random()`
alone, whose sequence Python guarantees for a given seed across versions (`randint`, `choice`
and `shuffle` carry no such promise), so every install builds the same rows.

Salaries and budgets are distinct by construction: questions such as "which instructor earns
the most" then have exactly one right answer.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Sequence
from typing import TypeVar

SEED = 20240611
T = TypeVar("T")

SCHEMA = """
CREATE TABLE department (
  department_id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  building TEXT,
  budget INTEGER
);
CREATE TABLE instructor (
  instructor_id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  department_id INTEGER,
  salary INTEGER,
  hire_year INTEGER,
  FOREIGN KEY (department_id) REFERENCES department(department_id)
);
CREATE TABLE course (
  course_id INTEGER PRIMARY KEY,
  title TEXT NOT NULL,
  department_id INTEGER,
  instructor_id INTEGER,
  credits INTEGER,
  FOREIGN KEY (department_id) REFERENCES department(department_id),
  FOREIGN KEY (instructor_id) REFERENCES instructor(instructor_id)
);
CREATE TABLE student (
  student_id INTEGER PRIMARY KEY,
  first_name TEXT NOT NULL,
  last_name TEXT NOT NULL,
  major_id INTEGER,
  enrollment_year INTEGER,
  city TEXT,
  FOREIGN KEY (major_id) REFERENCES department(department_id)
);
CREATE TABLE enrollment (
  student_id INTEGER,
  course_id INTEGER,
  semester TEXT,
  score INTEGER,
  PRIMARY KEY (student_id, course_id),
  FOREIGN KEY (student_id) REFERENCES student(student_id),
  FOREIGN KEY (course_id) REFERENCES course(course_id)
);
"""

# (name, building, budget): one building per department, budgets all different.
DEPARTMENTS = (
    ("Computer Science", "Turing Hall", 950_000),
    ("Mathematics", "Noether Hall", 620_000),
    ("Physics", "Curie Building", 780_000),
    ("History", "Gibbon House", 410_000),
    ("Biology", "Darwin Building", 700_000),
    ("Economics", "Keynes Hall", 530_000),
)
# Four courses per department, each with its credits.
COURSES = (
    (("Introduction to Programming", 4), ("Databases", 3), ("Algorithms", 4),
     ("Operating Systems", 3)),
    (("Calculus I", 4), ("Linear Algebra", 3), ("Probability", 3), ("Number Theory", 2)),
    (("Mechanics", 4), ("Electromagnetism", 4), ("Quantum Physics", 3), ("Astronomy", 2)),
    (("Ancient Rome", 3), ("Medieval Europe", 3), ("Modern History", 2), ("Historiography", 2)),
    (("Genetics", 4), ("Ecology", 3), ("Cell Biology", 3), ("Botany", 2)),
    (("Microeconomics", 3), ("Macroeconomics", 3), ("Econometrics", 4), ("Game Theory", 2)),
)  # fmt: skip
# Three instructors per department, in department order.
INSTRUCTORS = (
    "Ada Lovelace", "Alan Kay", "Barbara Liskov",
    "Emmy Klein", "Carl Gauss", "Sofia Kovalevskaya",
    "Lise Meitner", "Niels Bohr", "Richard Feynman",
    "Mary Beard", "Edward Gibbon", "Eric Hobsbawm",
    "Rosalind Franklin", "Gregor Mendel", "Lynn Margulis",
    "Elinor Ostrom", "Adam Smith", "Amartya Sen",
)  # fmt: skip
FIRST_NAMES = (
    "Alice", "Bruno", "Chloe", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas",
    "Kira", "Liam", "Maya", "Nils", "Olivia", "Pablo", "Quinn", "Rosa", "Samir", "Tara",
)  # fmt: skip
LAST_NAMES = (
    "Adler", "Becker", "Costa", "Dubois", "Evans", "Fischer", "Garcia", "Hansen", "Ito",
    "Jensen", "Kowalski", "Lopez", "Moreau", "Novak", "Okafor", "Petrov",
)  # fmt: skip
CITIES = ("Boston", "Chicago", "Denver", "Seattle", "Austin")
YEARS = (2020, 2021, 2022, 2023)
SEMESTERS = ("Fall 2023", "Spring 2024")
STUDENTS = 120
COURSES_PER_STUDENT = (3, 6)


def _pick(rng: random.Random, items: Sequence[T]) -> T:
    return items[int(rng.random() * len(items))]


def _between(rng: random.Random, low: int, high: int) -> int:
    return low + int(rng.random() * (high - low + 1))


def _permuted(rng: random.Random, items: Sequence[T]) -> list[T]:
    keys = [rng.random() for _ in items]
    return [item for _, item in sorted(zip(keys, items, strict=True), key=lambda p: p[0])]


def build(conn: sqlite3.Connection, seed: int = SEED) -> None:
    """Create the university tables in an empty database and fill them."""
    rng = random.Random(seed)
    conn.executescript(SCHEMA)
    conn.executemany(
        "INSERT INTO department VALUES (?, ?, ?, ?)",
        [(i, *d) for i, d in enumerate(DEPARTMENTS, start=1)],
    )
    # Distinct salaries: a ladder of steps handed out in random order.
    salaries = _permuted(rng, [61_000 + 2_500 * i for i in range(len(INSTRUCTORS))])
    conn.executemany(
        "INSERT INTO instructor VALUES (?, ?, ?, ?, ?)",
        [
            (i, name, (i - 1) // 3 + 1, salaries[i - 1], _between(rng, 1995, 2022))
            for i, name in enumerate(INSTRUCTORS, start=1)
        ],
    )
    courses = []
    for d, titles in enumerate(COURSES, start=1):
        teachers = [3 * (d - 1) + k for k in (1, 2, 3)]
        for title, credits in titles:
            courses.append((len(courses) + 1, title, d, _pick(rng, teachers), credits))
    conn.executemany("INSERT INTO course VALUES (?, ?, ?, ?, ?)", courses)
    # First and last names pair up without repeats: 20 x 16 combinations for 120 students.
    names = _permuted(rng, [(f, last) for f in FIRST_NAMES for last in LAST_NAMES])[:STUDENTS]
    students = [
        (i, first, last, _between(rng, 1, len(DEPARTMENTS)), _pick(rng, YEARS), _pick(rng, CITIES))
        for i, (first, last) in enumerate(names, start=1)
    ]
    conn.executemany("INSERT INTO student VALUES (?, ?, ?, ?, ?, ?)", students)
    enrollments = []
    for student_id, *_ in students:
        count = _between(rng, *COURSES_PER_STUDENT)
        for course in _permuted(rng, courses)[:count]:
            score = _between(rng, 45, 100)
            enrollments.append((student_id, course[0], _pick(rng, SEMESTERS), score))
    conn.executemany("INSERT INTO enrollment VALUES (?, ?, ?, ?)", enrollments)

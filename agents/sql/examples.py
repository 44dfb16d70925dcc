"""Worked examples the writer sees before its question: one short exchange per query shape.

A 135M model given only the schema answers in prose ("The number of employees is 1."), or
writes SQL over tables it imagines (`artists`, `album_title`): measured greedy on the 91 test
questions, 15 replies held SQL and none ran. Four exchanges per database, each a question and
the bare query that answers it, show the reply's form, the exact table and column names, a
filter on a value named in the question (the model's own habit is `WHERE customer_id = 1`)
and the join pattern. Chosen on the train split (91 questions, greedy writer replies): three
examples without a value filter gave 84 replies with SQL, 22 that ran and returned rows and 4
right; these four give 91, 35 and 7.

The examples ask what no task asks (tests/test_sql_agent.py checks), so copying one never
answers a task.
"""

from __future__ import annotations

EXAMPLES: dict[str, tuple[tuple[str, str], ...]] = {
    "chinook": (
        ("How many albums are there?", "SELECT COUNT(*) FROM album;"),
        (
            "How many employees live in Calgary?",
            "SELECT COUNT(*) FROM employee WHERE city = 'Calgary';",
        ),
        (
            "What is the email address of the employee Nancy Edwards?",
            "SELECT email FROM employee WHERE first_name = 'Nancy' AND last_name = 'Edwards';",
        ),
        (
            "How many tracks belong to the Opera genre?",
            "SELECT COUNT(*) FROM track JOIN genre ON track.genre_id = genre.genre_id "
            "WHERE genre.name = 'Opera';",
        ),
    ),
    "university": (
        ("How many departments are there?", "SELECT COUNT(*) FROM department;"),
        (
            "How many students live in Boston?",
            "SELECT COUNT(*) FROM student WHERE city = 'Boston';",
        ),
        (
            "List the titles of the courses worth 2 credits.",
            "SELECT title FROM course WHERE credits = 2;",
        ),
        (
            "Who teaches Quantum Physics?",
            "SELECT instructor.name FROM course JOIN instructor "
            "ON course.instructor_id = instructor.instructor_id "
            "WHERE course.title = 'Quantum Physics';",
        ),
    ),
}


def examples(db: str) -> tuple[tuple[str, str], ...]:
    """The (question, query) exchanges shown for database `db` (none for an unknown one)."""
    return EXAMPLES.get(db, ())

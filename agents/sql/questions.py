"""The SQL agent's questions: natural-language questions with gold SQL, per database.

Each template is one question shape written once, with the values it is asked for (artists,
genres, countries, courses, ...) picked by hand from the data, so every question has an
answer. Shapes go from one-table lookups through joins of up to four tables to grouping,
ordering and nested aggregates. Questions whose answer is a ranked list say so and are marked
`ordered`; "the most" questions were checked to have no ties. The tests run every gold query.

SQL values are quoted here (`O'Reilly` becomes `'O''Reilly'`); question text shows them as is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Question:
    db: str
    question: str
    gold_sql: str
    # The answer is a ranked list: its order is part of being right.
    ordered: bool = False


def _quoted(value: str) -> str:
    return value.replace("'", "''")


def _each(db: str, question: str, sql: str, values: list, ordered: bool = False) -> list[Question]:
    """One question per value; a value is a string or a tuple filling {0}, {1}, ..."""
    out = []
    for value in values:
        args = value if isinstance(value, tuple) else (value,)
        out.append(
            Question(
                db,
                question.format(*args),
                sql.format(*(_quoted(a) if isinstance(a, str) else a for a in args)),
                ordered,
            )
        )
    return out


def _one(db: str, question: str, sql: str, ordered: bool = False) -> list[Question]:
    return [Question(db, question, sql, ordered)]


_TRACK_GENRE = "FROM track JOIN genre ON track.genre_id = genre.genre_id"
_ALBUM_ARTIST = "FROM album JOIN artist ON album.artist_id = artist.artist_id"
_TRACK_ARTIST = (
    "FROM track JOIN album ON track.album_id = album.album_id "
    "JOIN artist ON album.artist_id = artist.artist_id"
)
_CUSTOMER = "WHERE first_name = '{0}' AND last_name = '{1}'"
_CUSTOMERS = [
    ("Mark", "Philips"),
    ("Frank", "Harris"),
    ("Michelle", "Brooks"),
    ("Camille", "Bernard"),
    ("Lucas", "Mancini"),
    ("Emma", "Jones"),
    ("Manoj", "Pareek"),
    ("Luis", "Rojas"),
    ("John", "Gordon"),
    ("Martha", "Silk"),
    ("Mark", "Taylor"),
    ("Hugh", "O'Reilly"),
]


def chinook() -> list[Question]:
    db = "chinook"
    # fmt: off
    return [
        *_each(
            db,
            "How many tracks belong to the {0} genre?",
            f"SELECT COUNT(*) {_TRACK_GENRE} WHERE genre.name = '{{0}}'",
            ["Rock", "Latin", "Metal", "Jazz", "Blues", "Classical", "Reggae", "Pop",
             "Soundtrack", "Hip Hop/Rap", "World", "Comedy"],
        ),
        *_each(
            db,
            "List the titles of the albums by {0}.",
            f"SELECT album.title {_ALBUM_ARTIST} WHERE artist.name = '{{0}}'",
            ["AC/DC", "Audioslave", "Foo Fighters", "Faith No More", "Van Halen", "Queen",
             "Santana", "Miles Davis", "Jamiroquai", "The Rolling Stones"],
        ),
        *_each(
            db,
            "How many albums by {0} does the store have?",
            f"SELECT COUNT(*) {_ALBUM_ARTIST} WHERE artist.name = '{{0}}'",
            ["Iron Maiden", "Led Zeppelin", "Deep Purple", "U2", "Metallica", "Ozzy Osbourne",
             "Pearl Jam", "R.E.M."],
        ),
        *_each(
            db,
            "How many tracks by {0} are in the store?",
            f"SELECT COUNT(*) {_TRACK_ARTIST} WHERE artist.name = '{{0}}'",
            ["Nirvana", "Pink Floyd", "Kiss", "Aerosmith", "The Doors", "Red Hot Chili Peppers"],
        ),
        *_each(
            db,
            "Which artist recorded the album '{0}'?",
            f"SELECT artist.name {_ALBUM_ARTIST} WHERE album.title = '{{0}}'",
            ["Big Ones", "Jagged Little Pill", "Nevermind", "Ten", "Achtung Baby",
             "Dark Side Of The Moon", "Use Your Illusion I"],
        ),
        *_each(
            db,
            "List the names of the tracks on the album '{0}'.",
            "SELECT track.name FROM track JOIN album ON track.album_id = album.album_id "
            "WHERE album.title = '{0}'",
            ["Facelift", "Out Of Exile", "Purpendicular", "Appetite for Destruction",
             "Killers", "Stormbringer", "Let There Be Rock", "Faceless"],
        ),
        *_each(
            db,
            "Who composed the track '{0}'?",
            "SELECT composer FROM track WHERE name = '{0}'",
            ["Whole Lotta Rosie", "You Learn", "Show Me How to Live",
             "Who Wants To Live Forever", "Cold Gin", "Miles Runs The Voodoo Down"],
        ),
        *_each(
            db,
            "What is the average length in milliseconds of the {0} tracks?",
            f"SELECT AVG(track.milliseconds) {_TRACK_GENRE} WHERE genre.name = '{{0}}'",
            ["Jazz", "Metal", "Blues", "Reggae", "Classical", "Alternative"],
        ),
        *_each(
            db,
            "How many tracks are longer than {0} minutes?",
            "SELECT COUNT(*) FROM track WHERE milliseconds > {0} * 60000",
            [5, 6, 8, 10],
        ),
        *_each(
            db,
            "How many tracks are in the playlist called '{0}'?",
            "SELECT COUNT(*) FROM playlist_track JOIN playlist "
            "ON playlist_track.playlist_id = playlist.playlist_id WHERE playlist.name = '{0}'",
            ["Brazilian Music", "Classical 101 - Deep Cuts", "Grunge", "Heavy Metal Classic",
             "Classical"],
        ),
        *_each(
            db,
            "How much revenue did {0} tracks bring in?",
            "SELECT SUM(invoice_line.unit_price * invoice_line.quantity) FROM invoice_line "
            "JOIN track ON invoice_line.track_id = track.track_id "
            "JOIN genre ON track.genre_id = genre.genre_id WHERE genre.name = '{0}'",
            ["Rock", "Jazz", "Metal", "Latin", "Blues"],
        ),
        *_each(
            db,
            "Which country does the customer {0} {1} live in?",
            f"SELECT country FROM customer {_CUSTOMER}",
            _CUSTOMERS[:8],
        ),
        *_each(
            db,
            "What is the email address of {0} {1}?",
            f"SELECT email FROM customer {_CUSTOMER}",
            _CUSTOMERS[6:11],
        ),
        *_each(
            db,
            "How many invoices does {0} {1} have?",
            "SELECT COUNT(*) FROM invoice JOIN customer "
            "ON invoice.customer_id = customer.customer_id "
            "WHERE customer.first_name = '{0}' AND customer.last_name = '{1}'",
            _CUSTOMERS[2:7],
        ),
        *_each(
            db,
            "Who is the support representative of the customer {0} {1}? "
            "Give the employee's first and last name.",
            "SELECT employee.first_name, employee.last_name FROM customer JOIN employee "
            "ON customer.support_rep_id = employee.employee_id "
            "WHERE customer.first_name = '{0}' AND customer.last_name = '{1}'",
            [_CUSTOMERS[i] for i in (0, 3, 5, 8, 9, 11)],
        ),
        *_each(
            db,
            "How many customers are from {0}?",
            "SELECT COUNT(*) FROM customer WHERE country = '{0}'",
            ["USA", "Canada", "France", "Brazil", "Germany", "United Kingdom", "India",
             "Portugal"],
        ),
        *_each(
            db,
            "List the first and last names of the customers from {0}.",
            "SELECT first_name, last_name FROM customer WHERE country = '{0}'",
            ["Portugal", "India", "Czech Republic", "Brazil"],
        ),
        *_each(
            db,
            "List the first and last names of the customers who live in {0}.",
            "SELECT first_name, last_name FROM customer WHERE city = '{0}'",
            ["Berlin", "London", "Mountain View", "Paris", "Prague", "Toronto", "Dublin"],
        ),
        *_each(
            db,
            "What is the total of all invoices billed to {0}?",
            "SELECT SUM(total) FROM invoice WHERE billing_country = '{0}'",
            ["USA", "Canada", "France", "Germany", "Czech Republic", "Chile"],
        ),
        *_each(
            db,
            "How many tracks in total were bought by customers billed in {0}?",
            "SELECT SUM(invoice_line.quantity) FROM invoice_line JOIN invoice "
            "ON invoice_line.invoice_id = invoice.invoice_id "
            "WHERE invoice.billing_country = '{0}'",
            ["Brazil", "Norway", "Spain", "India", "Australia"],
        ),
        *_each(
            db,
            "How many invoices were issued in {0}?",
            "SELECT COUNT(*) FROM invoice WHERE strftime('%Y', invoice_date) = '{0}'",
            ["2007", "2008", "2009", "2010", "2011"],
        ),
        *_each(
            db,
            "What were the total sales in {0}?",
            "SELECT SUM(total) FROM invoice WHERE strftime('%Y', invoice_date) = '{0}'",
            ["2007", "2008", "2009", "2010", "2011"],
        ),
        *_each(
            db,
            "How many customers does the employee {0} {1} support?",
            "SELECT COUNT(*) FROM customer JOIN employee "
            "ON customer.support_rep_id = employee.employee_id "
            "WHERE employee.first_name = '{0}' AND employee.last_name = '{1}'",
            [("Jane", "Peacock"), ("Margaret", "Park"), ("Steve", "Johnson")],
        ),
        *_each(
            db,
            "Who does {0} {1} report to? Give the manager's first and last name.",
            "SELECT manager.first_name, manager.last_name FROM employee "
            "JOIN employee AS manager ON employee.reports_to = manager.employee_id "
            "WHERE employee.first_name = '{0}' AND employee.last_name = '{1}'",
            [("Nancy", "Edwards"), ("Jane", "Peacock"), ("Margaret", "Park"),
             ("Steve", "Johnson"), ("Michael", "Mitchell"), ("Robert", "King"),
             ("Laura", "Callahan")],
        ),
        *_each(
            db,
            "What is the job title of the employee {0} {1}?",
            "SELECT title FROM employee WHERE first_name = '{0}' AND last_name = '{1}'",
            [("Andrew", "Adams"), ("Nancy", "Edwards"), ("Michael", "Mitchell"),
             ("Robert", "King")],
        ),
        *_one(db, "How many artists are there?", "SELECT COUNT(*) FROM artist"),
        *_one(db, "How many playlists are there?", "SELECT COUNT(*) FROM playlist"),
        *_one(db, "What are the names of all media types?", "SELECT name FROM media_type"),
        *_one(db, "What is the average invoice total?", "SELECT AVG(total) FROM invoice"),
        *_one(
            db,
            "How many tracks cost more than 0.99?",
            "SELECT COUNT(*) FROM track WHERE unit_price > 0.99",
        ),
        *_one(
            db,
            "How many tracks have no composer listed?",
            "SELECT COUNT(*) FROM track WHERE composer IS NULL",
        ),
        *_one(
            db,
            "Which employee has no manager? Give the first and last name.",
            "SELECT first_name, last_name FROM employee WHERE reports_to IS NULL",
        ),
        *_one(
            db,
            "What is the name of the longest track?",
            "SELECT name FROM track ORDER BY milliseconds DESC LIMIT 1",
        ),
        *_one(
            db,
            "Which genre has the most tracks?",
            f"SELECT genre.name {_TRACK_GENRE} GROUP BY genre.genre_id "
            "ORDER BY COUNT(*) DESC LIMIT 1",
        ),
        *_one(
            db,
            "Which artist has the most albums?",
            f"SELECT artist.name {_ALBUM_ARTIST} GROUP BY artist.artist_id "
            "ORDER BY COUNT(*) DESC LIMIT 1",
        ),
        *_one(
            db,
            "Which album has the most tracks?",
            "SELECT album.title FROM track JOIN album ON track.album_id = album.album_id "
            "GROUP BY album.album_id ORDER BY COUNT(*) DESC LIMIT 1",
        ),
        *_one(
            db,
            "Which customer has spent the most money? Give the first and last name.",
            "SELECT customer.first_name, customer.last_name FROM invoice JOIN customer "
            "ON invoice.customer_id = customer.customer_id GROUP BY customer.customer_id "
            "ORDER BY SUM(invoice.total) DESC LIMIT 1",
        ),
        *_one(
            db,
            "Which billing country has the highest total sales?",
            "SELECT billing_country FROM invoice GROUP BY billing_country "
            "ORDER BY SUM(total) DESC LIMIT 1",
        ),
        *_one(
            db,
            "How many customers are there in each country? Give the country and the count.",
            "SELECT country, COUNT(*) FROM customer GROUP BY country",
        ),
        *_one(
            db,
            "How many tracks use each media type? Give the media type name and the count.",
            "SELECT media_type.name, COUNT(*) FROM track JOIN media_type "
            "ON track.media_type_id = media_type.media_type_id GROUP BY media_type.media_type_id",
        ),
        *_one(
            db,
            "What are the total sales of each year? Give the year and the total.",
            "SELECT strftime('%Y', invoice_date), SUM(total) FROM invoice "
            "GROUP BY strftime('%Y', invoice_date)",
        ),
        *_one(
            db,
            "Which albums have more than 25 tracks? Give their titles.",
            "SELECT album.title FROM track JOIN album ON track.album_id = album.album_id "
            "GROUP BY album.album_id HAVING COUNT(*) > 25",
        ),
        *_one(
            db,
            "How much did the customers of each support representative spend in total? Give "
            "the employee's first name and the total.",
            "SELECT employee.first_name, SUM(invoice.total) FROM employee "
            "JOIN customer ON customer.support_rep_id = employee.employee_id "
            "JOIN invoice ON invoice.customer_id = customer.customer_id "
            "GROUP BY employee.employee_id",
        ),
        *_one(
            db,
            "List the names of the five longest tracks, longest first.",
            "SELECT name FROM track ORDER BY milliseconds DESC LIMIT 5",
            ordered=True,
        ),
        *_one(
            db,
            "List all genre names in alphabetical order.",
            "SELECT name FROM genre ORDER BY name",
            ordered=True,
        ),
        *_one(
            db,
            "List the first and last names of the employees from the oldest to the youngest.",
            "SELECT first_name, last_name FROM employee ORDER BY birth_date",
            ordered=True,
        ),
        *_one(
            db,
            "Which three billing countries have the highest total sales? List them from the "
            "highest total down.",
            "SELECT billing_country FROM invoice GROUP BY billing_country "
            "ORDER BY SUM(total) DESC LIMIT 3",
            ordered=True,
        ),
    ]
    # fmt: on


_STUDENTS = [
    ("Chloe", "Petrov"),
    ("Jonas", "Kowalski"),
    ("Farid", "Becker"),
    ("Olivia", "Hansen"),
    ("Jonas", "Garcia"),
    ("Samir", "Costa"),
    ("Tara", "Novak"),
    ("Quinn", "Moreau"),
    ("Grace", "Okafor"),
]
_DEPARTMENTS = [
    "Computer Science",
    "Mathematics",
    "Physics",
    "History",
    "Biology",
    "Economics",
]
_STUDENT = "WHERE student.first_name = '{0}' AND student.last_name = '{1}'"
_COURSE_ENROLLMENT = "FROM enrollment JOIN course ON enrollment.course_id = course.course_id"
_STUDENT_ENROLLMENT = "FROM enrollment JOIN student ON enrollment.student_id = student.student_id"


def university() -> list[Question]:
    db = "university"
    # fmt: off
    return [
        *_each(
            db,
            "How many students major in {0}?",
            "SELECT COUNT(*) FROM student JOIN department "
            "ON student.major_id = department.department_id WHERE department.name = '{0}'",
            _DEPARTMENTS,
        ),
        *_each(
            db,
            "List the names of the instructors in the {0} department.",
            "SELECT instructor.name FROM instructor JOIN department "
            "ON instructor.department_id = department.department_id "
            "WHERE department.name = '{0}'",
            _DEPARTMENTS,
        ),
        *_each(
            db,
            "What is the budget of the {0} department?",
            "SELECT budget FROM department WHERE name = '{0}'",
            _DEPARTMENTS,
        ),
        *_each(
            db,
            "In which building is the {0} department?",
            "SELECT building FROM department WHERE name = '{0}'",
            _DEPARTMENTS[:4],
        ),
        *_each(
            db,
            "Which courses does the {0} department offer? Give their titles.",
            "SELECT course.title FROM course JOIN department "
            "ON course.department_id = department.department_id WHERE department.name = '{0}'",
            _DEPARTMENTS,
        ),
        *_each(
            db,
            "What is the highest instructor salary in the {0} department?",
            "SELECT MAX(instructor.salary) FROM instructor JOIN department "
            "ON instructor.department_id = department.department_id "
            "WHERE department.name = '{0}'",
            _DEPARTMENTS[1:],
        ),
        *_each(
            db,
            "How many credits is the course {0} worth?",
            "SELECT credits FROM course WHERE title = '{0}'",
            ["Databases", "Calculus I", "Astronomy", "Ancient Rome", "Genetics", "Game Theory"],
        ),
        *_each(
            db,
            "Who teaches {0}?",
            "SELECT instructor.name FROM course JOIN instructor "
            "ON course.instructor_id = instructor.instructor_id WHERE course.title = '{0}'",
            ["Algorithms", "Linear Algebra", "Mechanics", "Medieval Europe", "Ecology",
             "Econometrics"],
        ),
        *_each(
            db,
            "What is the average score in {0}?",
            f"SELECT AVG(enrollment.score) {_COURSE_ENROLLMENT} WHERE course.title = '{{0}}'",
            ["Operating Systems", "Probability", "Quantum Physics", "Modern History",
             "Cell Biology", "Microeconomics"],
        ),
        *_each(
            db,
            "How many students are enrolled in {0}?",
            f"SELECT COUNT(*) {_COURSE_ENROLLMENT} WHERE course.title = '{{0}}'",
            ["Introduction to Programming", "Number Theory", "Electromagnetism",
             "Historiography", "Botany", "Macroeconomics"],
        ),
        *_each(
            db,
            "Which department does {0} work in?",
            "SELECT department.name FROM instructor JOIN department "
            "ON instructor.department_id = department.department_id "
            "WHERE instructor.name = '{0}'",
            ["Alan Kay", "Emmy Klein", "Niels Bohr", "Mary Beard", "Gregor Mendel",
             "Amartya Sen"],
        ),
        *_each(
            db,
            "What is the salary of {0}?",
            "SELECT salary FROM instructor WHERE name = '{0}'",
            ["Ada Lovelace", "Carl Gauss", "Richard Feynman", "Rosalind Franklin"],
        ),
        *_each(
            db,
            "How many students started in {0}?",
            "SELECT COUNT(*) FROM student WHERE enrollment_year = {0}",
            [2020, 2021, 2022, 2023],
        ),
        *_each(
            db,
            "List the first and last names of the students who live in {0}.",
            "SELECT first_name, last_name FROM student WHERE city = '{0}'",
            ["Boston", "Chicago", "Denver", "Seattle", "Austin"],
        ),
        *_each(
            db,
            "How many courses is {0} {1} taking?",
            f"SELECT COUNT(*) {_STUDENT_ENROLLMENT} {_STUDENT}",
            _STUDENTS[:5],
        ),
        *_each(
            db,
            "What is the average score of the student {0} {1}?",
            f"SELECT AVG(enrollment.score) {_STUDENT_ENROLLMENT} {_STUDENT}",
            _STUDENTS[4:],
        ),
        *_each(
            db,
            "Which courses is {0} {1} enrolled in? Give the course titles.",
            "SELECT course.title FROM enrollment "
            "JOIN student ON enrollment.student_id = student.student_id "
            f"JOIN course ON enrollment.course_id = course.course_id {_STUDENT}",
            _STUDENTS[::2],
        ),
        *_one(
            db,
            "Which department has the largest budget?",
            "SELECT name FROM department ORDER BY budget DESC LIMIT 1",
        ),
        *_one(
            db,
            "What is the total budget of all departments?",
            "SELECT SUM(budget) FROM department",
        ),
        *_one(
            db, "What is the average instructor salary?", "SELECT AVG(salary) FROM instructor"
        ),
        *_one(
            db,
            "Which instructor has the highest salary?",
            "SELECT name FROM instructor ORDER BY salary DESC LIMIT 1",
        ),
        *_one(
            db,
            "How many courses are worth 4 credits?",
            "SELECT COUNT(*) FROM course WHERE credits = 4",
        ),
        *_one(
            db,
            "How many enrollments are there in the Fall 2023 semester?",
            "SELECT COUNT(*) FROM enrollment WHERE semester = 'Fall 2023'",
        ),
        *_one(
            db,
            "List the names of the instructors hired after 2015.",
            "SELECT name FROM instructor WHERE hire_year > 2015",
        ),
        *_one(
            db,
            "Which instructors do not teach any course?",
            "SELECT name FROM instructor "
            "WHERE instructor_id NOT IN (SELECT instructor_id FROM course)",
        ),
        *_one(
            db,
            "Which course has the most students enrolled?",
            f"SELECT course.title {_COURSE_ENROLLMENT} GROUP BY course.course_id "
            "ORDER BY COUNT(*) DESC LIMIT 1",
        ),
        *_one(
            db,
            "Which students scored 100 in a course? Give their first and last names.",
            f"SELECT DISTINCT student.first_name, student.last_name {_STUDENT_ENROLLMENT} "
            "WHERE enrollment.score = 100",
        ),
        *_one(
            db,
            "How many students live in each city? Give the city and the count.",
            "SELECT city, COUNT(*) FROM student GROUP BY city",
        ),
        *_one(
            db,
            "How many instructors does each department have? Give the department name and "
            "the count.",
            "SELECT department.name, COUNT(*) FROM instructor JOIN department "
            "ON instructor.department_id = department.department_id "
            "GROUP BY department.department_id",
        ),
        *_one(
            db,
            "What is the average score in each semester? Give the semester and the average.",
            "SELECT semester, AVG(score) FROM enrollment GROUP BY semester",
        ),
        *_one(
            db,
            "List the department names from the largest budget to the smallest.",
            "SELECT name FROM department ORDER BY budget DESC",
            ordered=True,
        ),
        *_one(
            db,
            "List the names of the three best-paid instructors, highest salary first.",
            "SELECT name FROM instructor ORDER BY salary DESC LIMIT 3",
            ordered=True,
        ),
        *_one(
            db,
            "List the course titles of the Computer Science department in alphabetical order.",
            "SELECT course.title FROM course JOIN department "
            "ON course.department_id = department.department_id "
            "WHERE department.name = 'Computer Science' ORDER BY course.title",
            ordered=True,
        ),
    ]
    # fmt: on


def all_questions() -> list[Question]:
    return chinook() + university()

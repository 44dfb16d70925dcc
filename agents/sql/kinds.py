"""Questions of kinds the train and test splits never ask: the SQL agent's "kinds" split.

Train and test (data.py) divide the questions of questions.py by a hash of each question, so
every question shape there has values on both sides: a test question is a new value in a shape
that training has seen. The templates here are shapes that questions.py does not have at all
(the price of a track, the city of an employee, the artist of a track, the hire year of an
instructor, ...), held out as a whole: a policy trained on train has never seen these shapes,
and its accuracy on them measures how far it generalises to kinds of questions it was never
trained on, not just to new values.

Values were picked from the data like those of questions.py: every gold query returns a
non-empty, non-zero, non-NULL answer, and every name asked for is unique in its table. The
tier of each question is read from its gold query (tiers.py), like everywhere else.
"""

from __future__ import annotations

from lightning_rl.agents.sql.questions import Question, _each

_TRACK_ARTIST = (
    "FROM track JOIN album ON track.album_id = album.album_id "
    "JOIN artist ON album.artist_id = artist.artist_id"
)
_NAMED = "WHERE first_name = '{0}' AND last_name = '{1}'"


def chinook() -> list[Question]:
    db = "chinook"
    # fmt: off
    return [
        *_each(
            db,
            "What does the track '{0}' cost?",
            "SELECT unit_price FROM track WHERE name = '{0}'",
            ["Occupation / Precipice", "Bohemian Rhapsody", "Sweet Child O' Mine"],
        ),
        *_each(
            db,
            "In which city does the employee {0} {1} live?",
            f"SELECT city FROM employee {_NAMED}",
            [("Andrew", "Adams"), ("Jane", "Peacock"), ("Robert", "King")],
        ),
        *_each(
            db,
            "Which company does the customer {0} {1} work for?",
            f"SELECT company FROM customer {_NAMED}",
            [("Frank", "Harris"), ("Tim", "Goyer"), ("Alexandre", "Rocha")],
        ),
        *_each(
            db,
            "How many tracks are stored as '{0}' files?",
            "SELECT COUNT(*) FROM track JOIN media_type "
            "ON track.media_type_id = media_type.media_type_id WHERE media_type.name = '{0}'",
            ["Protected AAC audio file", "Protected MPEG-4 video file", "AAC audio file"],
        ),
        *_each(
            db,
            "How many playlists include the track '{0}'?",
            "SELECT COUNT(*) FROM playlist_track JOIN track "
            "ON playlist_track.track_id = track.track_id WHERE track.name = '{0}'",
            ["Jeremy", "Give It Away", "Roxanne"],
        ),
        *_each(
            db,
            "What is the largest single invoice total of the customer {0} {1}?",
            "SELECT MAX(invoice.total) FROM invoice JOIN customer "
            "ON invoice.customer_id = customer.customer_id "
            "WHERE customer.first_name = '{0}' AND customer.last_name = '{1}'",
            [("Helena", "Holý"), ("Richard", "Cunningham"), ("Victor", "Stevens")],
        ),
        *_each(
            db,
            "Which artist performed the track '{0}'?",
            f"SELECT artist.name {_TRACK_ARTIST} WHERE track.name = '{{0}}'",
            ["Under Pressure", "Highway Star", "Light My Fire"],
        ),
        *_each(
            db,
            "How many different customers bought at least one {0} track?",
            "SELECT COUNT(DISTINCT invoice.customer_id) FROM invoice_line JOIN invoice "
            "ON invoice_line.invoice_id = invoice.invoice_id "
            "JOIN track ON invoice_line.track_id = track.track_id "
            "JOIN genre ON track.genre_id = genre.genre_id WHERE genre.name = '{0}'",
            ["Jazz", "Blues", "Reggae"],
        ),
    ]
    # fmt: on


_INSTRUCTOR_COURSES = (
    "FROM course JOIN instructor ON course.instructor_id = instructor.instructor_id"
)


def university() -> list[Question]:
    db = "university"
    # fmt: off
    return [
        *_each(
            db,
            "In which year was {0} hired?",
            "SELECT hire_year FROM instructor WHERE name = '{0}'",
            ["Barbara Liskov", "Lise Meitner", "Edward Gibbon"],
        ),
        *_each(
            db,
            "In which city does the student {0} {1} live?",
            f"SELECT city FROM student {_NAMED}",
            [("Alice", "Jensen"), ("Rosa", "Dubois"), ("Liam", "Moreau")],
        ),
        *_each(
            db,
            "How many courses does {0} teach?",
            f"SELECT COUNT(*) {_INSTRUCTOR_COURSES} WHERE instructor.name = '{{0}}'",
            ["Barbara Liskov", "Amartya Sen", "Sofia Kovalevskaya"],
        ),
        *_each(
            db,
            "Which department does the student {0} {1} major in?",
            "SELECT department.name FROM student JOIN department "
            "ON student.major_id = department.department_id "
            "WHERE student.first_name = '{0}' AND student.last_name = '{1}'",
            [("Kira", "Kowalski"), ("Pablo", "Garcia"), ("Nils", "Fischer")],
        ),
        *_each(
            db,
            "What is the average salary of the instructors in the {0} department?",
            "SELECT AVG(instructor.salary) FROM instructor JOIN department "
            "ON instructor.department_id = department.department_id "
            "WHERE department.name = '{0}'",
            ["Computer Science", "Physics", "Biology"],
        ),
        *_each(
            db,
            "How many enrollments in courses of the {0} department have a score above 90?",
            "SELECT COUNT(*) FROM enrollment JOIN course "
            "ON enrollment.course_id = course.course_id "
            "JOIN department ON course.department_id = department.department_id "
            "WHERE department.name = '{0}' AND enrollment.score > 90",
            ["Computer Science", "Biology", "Economics"],
        ),
        *_each(
            db,
            "What is the average score of the students taught by {0}?",
            "SELECT AVG(enrollment.score) FROM enrollment JOIN course "
            "ON enrollment.course_id = course.course_id "
            "JOIN instructor ON course.instructor_id = instructor.instructor_id "
            "WHERE instructor.name = '{0}'",
            ["Niels Bohr", "Lynn Margulis", "Mary Beard"],
        ),
    ]
    # fmt: on


def kind_questions() -> list[Question]:
    """Every question of the "kinds" split: shapes that no train or test question has."""
    return chinook() + university()

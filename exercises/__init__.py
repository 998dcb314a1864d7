"""Classroom exercises that check themselves (docs/exercises.md).

Each `NN_name.py` holds the answer functions of one exercise; `check.py` compares them with the
project's own code (`python exercises/check.py N`); `make_student_copy.py` copies the project with
those functions blanked out.
"""

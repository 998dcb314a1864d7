"""The grader of the exercises: the checks (checks_*.py, checking.py), how an answer runs apart from
them (grading.py, room.py, sandbox.py, runner.py, feeding.py and the feed_*.py modules), the hints,
and the teacher's tools (make_student_copy.py, plot_capstone.py). A student opens the exercise files
and check.py, one folder up; nothing here is theirs to edit.
"""

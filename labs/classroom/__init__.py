"""The lab as a class: a student's kit without solutions, and an autograder for it.

    python -m labs.classroom init DIR              # write a student's kit
    python -m labs.classroom grade DIR [DIR...]    # grade kits (or a folder of kits): one table
    python -m labs.classroom build DIR             # a kit's patched Horovod (cached)
    python -m labs.classroom similar DIR           # which kits look alike (for you, never a grade)
    python -m labs.classroom demo DIR              # the grader graded: solution, untouched kit,
                                                   # seeded mistakes, as a class to grade

docs/instructor.md is the guide. Modules: kit (init, the solution), sandbox (each kit's
bubblewrap sandbox), student_side (the only grader code inside one: raw outputs), kit_runs (a
sandboxed run and its outputs read back), schema (every output held to its schema), replay,
codec_checks and compressor_checks (step 2: the kit's outputs judged against the reference),
job_checks (steps 1 and 3a), course_net (the grader's copy of the course's network, to score a
trainer's weights), intree (step 3b), report_checks (step 5), grade, sheet, similarity,
mistakes and red_team (the grader graded).
"""

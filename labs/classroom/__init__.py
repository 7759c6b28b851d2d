"""The lab as a class: a student's kit without solutions, and an autograder for it.

    python -m labs.classroom init DIR              # write a student's kit
    python -m labs.classroom grade DIR [DIR...]    # grade kits (or a folder of kits): one table
    python -m labs.classroom build DIR             # build a kit's patched Horovod (cached)
    python -m labs.classroom demo DIR              # the grader graded: solution, untouched kit,
                                                   # seeded mistakes, as a class to grade

docs/instructor.md is the guide. Modules: kit (init, the solution), codec_checks and
compressor_checks (step 2, in one process), rank_job and job_checks (steps 1 and 3a, on
Horovod ranks), intree and intree_job (step 3b), report_checks (step 5), grade, sheet.
"""

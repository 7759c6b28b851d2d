"""horovodrun inside a kit's sandbox, without its build check (copied to /grader beside the
student side).

    python launcher.py -np N --gloo python student_side.py ranks JOB OUT

Before it starts a rank, horovodrun asks whether Horovod was built with the controller asked
for, by importing horovod.torch (torch) in a process of its own: about 2 s of a core at every
launch, and the grader launches once per kit and world size. The grader only asks for
--gloo, on a build it knows has Gloo. A file of its own, importing nothing heavy: horovodrun
starts a middleman process per rank by multiprocessing's spawn, which imports this file again.
"""
import sys

if __name__ == "__main__":
    from horovod.runner import launch
    launch.gloo_built = lambda verbose=False: True
    sys.argv = ["horovodrun"] + sys.argv[1:]
    sys.exit(launch.run_commandline())

"""The course lab: the trainer (mnist.py), the lab kit and the network emulator."""

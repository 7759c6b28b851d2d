"""labs/ddp_mnist.py with one fault, for tests/test_ddp_elastic.py under real torchrun: on
torchrun's first attempt, rank HVDC_DIE_RANK (default 1) leaves at once by os._exit, as a
crash does (no clean-up, its sockets closed by the kernel), when it has trained
HVDC_DIE_AT_STEP steps. Every attempt of every rank notes in HVDC_ATTEMPT_DIR what it did: the
epoch it resumed from and the hook state it loaded (the real calls, observed and passed on)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hvd_compress.ddp as hcd                      # noqa: E402
from labs import ddp_mnist                          # noqa: E402
from labs.kit.recorder import RunRecorder           # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ["RANK"])
DIE_RANK = int(os.environ.get("HVDC_DIE_RANK", "1"))
DIE_AT = int(os.environ["HVDC_DIE_AT_STEP"])
NOTES = Path(os.environ["HVDC_ATTEMPT_DIR"]) / f"attempt{ATTEMPT}-rank{RANK}.json"
record = {"attempt": ATTEMPT, "rank": RANK, "pid": os.getpid(), "hook_state_loaded": []}


def note(**fields):
    record.update(fields)
    NOTES.write_text(json.dumps(record))


_resume, _steps = RunRecorder.resume, RunRecorder.steps
_load = hcd.HookState.load_compression_state_dict


def resume(self, model, optimizer):
    first = _resume(self, model, optimizer)
    note(first_epoch=first)
    return first


def steps(self, epoch, batches, *args, **kwargs):
    for step in _steps(self, epoch, batches, *args, **kwargs):
        if ATTEMPT == 0 and self.rank == DIE_RANK and self.step == DIE_AT:
            note(died_at=self.step)
            os._exit(17)
        yield step


def load_state_dict(self, state, plan=True):
    record["hook_state_loaded"].append({"scheme": state.get("scheme"), "steps": state.get("steps"),
                                        "with_plan": "communicator" in state, "plan": plan})
    note()
    return _load(self, state, plan)


RunRecorder.resume, RunRecorder.steps = resume, steps
hcd.HookState.load_compression_state_dict = load_state_dict

if __name__ == "__main__":
    note()
    ddp_mnist.main()

"""One check's result, and the course's steps in the order a class does them."""
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# step id -> (English title, Chinese title); the grade sheet's columns, in course order
STEPS = {
    "trainer": ("1. Data-parallel trainer", "1. 数据并行训练"),
    "codecs": ("2. Bit8/Bit16 codecs", "2. Bit8/Bit16 编解码"),
    "exchange": ("3a. Allgather exchange", "3a. allgather 交换"),
    "intree": ("3b. Patched Horovod", "3b. 修改 Horovod"),
    "report": ("5. Report", "5. 实验报告"),
}


@dataclass
class Check:
    """A check that passed, or failed with a reason a student can act on (en and zh)."""
    step: str
    name: str
    passed: bool
    en: str = ""
    zh: str = ""
    details: dict = field(default_factory=dict)

    def reason(self, lang):
        return self.zh if lang == "zh" and self.zh else self.en


def ok(step, name, **details):
    return Check(step, name, True, details=details)


def fail(step, name, en, zh, **details):
    return Check(step, name, False, en, zh, details)


def error_text(err):
    """'NotImplementedError: TODO ... (compression.py:52)': what went wrong and where (an error
    the kit raised in its sandbox comes as the student side wrote it down)."""
    if hasattr(err, "type_name"):
        return err.text
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def raised(step, name, what, err):
    """A failure for student code that raised: the error, where, and what to do."""
    text = error_text(err)
    if getattr(err, "type_name", type(err).__name__) == "NotImplementedError":
        return fail(step, name, f"{what}: not written yet ({text}); write it.",
                    f"{what}：尚未实现（{text}）；请完成它。")
    return fail(step, name, f"{what} raised {text}.", f"{what} 抛出异常 {text}。")

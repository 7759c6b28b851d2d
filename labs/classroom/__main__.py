"""Command line of labs.classroom (see the package docstring)."""
import argparse
import sys
from pathlib import Path

from .checks import STEPS
from .grade import GradeError, Options, QUICK, find_kits, grade
from .kit import KitError, init, install_solution
from .mistakes import MISTAKES, seed
from .sheet import csv_text, markdown, write_sheets


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m labs.classroom", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init", help="write a student's kit into DIR")
    p.add_argument("dir")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    p = sub.add_parser("grade", help="grade kits, or folders of kits: one table")
    p.add_argument("paths", nargs="+")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"comma-separated, from {','.join(STEPS)} (default: all)")
    p.add_argument("--lang", choices=["en", "zh", "both"], default="en")
    p.add_argument("--out", default=None, help="folder for grades.md / grades.csv (default: the "
                   "single path given, else the current folder)")
    p.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "mnist"])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--train-samples", type=int, default=QUICK["train_samples"],
                   help="training images for the grader's runs (0: all; default %(default)s)")
    p.add_argument("--test-samples", type=int, default=QUICK["test_samples"])
    p.add_argument("--epochs", type=int, default=QUICK["epochs"])
    p.add_argument("--min-accuracy", type=float, default=QUICK["min_accuracy"],
                   help="accuracy rank 0's model must reach (default %(default)s, documented "
                        "for the default run)")
    p.add_argument("--parallel", type=int, default=3,
                   help="kits graded at once, each in its own sandboxes (default %(default)s)")
    p.add_argument("--exhaustive", action="store_true",
                   help="also every one of the 2**32 float32 inputs (minutes per kit)")
    p = sub.add_parser("build", help="build a kit's patched Horovod (cached by the patches' hash)")
    p.add_argument("dir")
    p = sub.add_parser("similar", help="which kits look like the reference solution, the "
                                       "project's codecs or each other (for you to read, never "
                                       "a grade): similarity.md")
    p.add_argument("paths", nargs="+")
    p.add_argument("--out", default=None, help="folder for similarity.md (default: as grade)")
    p.add_argument("--top", type=int, default=20, help="pairs of kits shown (default %(default)s); "
                   "every kit is shown against the solution and the project's code")
    p = sub.add_parser("demo", help="the grader graded: solution, untouched kit and seeded "
                                    "mistakes as kits in DIR")
    p.add_argument("dir")
    args = parser.parse_args(argv)

    try:
        if args.command == "init":
            print(f"wrote the kit into {init(args.dir, args.force)}: see its README.md")
            return 0
        if args.command == "demo":
            root = Path(args.dir)
            init(root / "untouched")
            install_solution(init(root / "solution"))
            for mistake in MISTAKES:
                seed(init(root / mistake.name), mistake)
            print(f"wrote {2 + len(MISTAKES)} kits into {root}: python -m labs.classroom grade {root}")
            return 0
        if args.command == "build":
            import shutil
            import tempfile
            from .intree import build
            work = Path(tempfile.mkdtemp(prefix="classroom-build-"))
            work.chmod(0o711)
            try:
                checks = build(Path(args.dir).resolve(), work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            for check in checks:
                print(f"{check.name}: {'ok' if check.passed else check.en}",
                      file=sys.stdout if check.passed else sys.stderr)
            return 0 if all(c.passed for c in checks) else 1
        kits = find_kits(args.paths)
        if args.command == "similar":
            from .similarity import report
            text = report(kits, args.top)
            write_sheets(Path(args.out or (args.paths[0] if len(args.paths) == 1 else ".")),
                         {"similarity.md": text})
            print(text)
            return 0
        options = Options(steps=tuple(s for s in args.steps.split(",") if s), dataset=args.dataset,
                          data_dir=args.data_dir, train_samples=args.train_samples,
                          test_samples=args.test_samples, epochs=args.epochs,
                          min_accuracy=args.min_accuracy, exhaustive=args.exhaustive,
                          parallel=args.parallel)
        results = grade(kits, options)
    except (GradeError, KitError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or (args.paths[0] if len(args.paths) == 1 else "."))
    sheets = {("grades.md" if lang == "en" else "grades.zh.md"): markdown(results, lang)
              for lang in (["en", "zh"] if args.lang == "both" else [args.lang])}
    sheets["grades.csv"] = csv_text(results)
    write_sheets(out, sheets)
    for name, text in sheets.items():
        if name.endswith(".md"):
            print(text)
    return 0 if all(c.passed for checks in results.values() for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

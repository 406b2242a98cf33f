"""`hopdec demo` end to end on the CPU: the reference decode, then the emulated executor's steps."""
import re

from executor.cli import main


def test_demo_runs_the_reference_then_the_emulated_executor(tiny_bundle_dir, capsys):
    assert main(["demo", "--tokens", "2", "--executor-steps", "2",
                 "--bundle", str(tiny_bundle_dir)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"generated \d+ tokens", out) and "wired stages per rank" in out
    rows = re.findall(r"^\s*(\d+) \|\s+(\d+) \|\s+(\d+) \|\s+(\d+) \|\s+(\S+) \|\s+(\d+) \|",
                      out, re.MULTILINE)
    assert len(rows) == 2
    for _step, _pos, reference, executor, diff, launches in rows:
        assert reference == executor and float(diff) <= 0.25 and int(launches) > 100

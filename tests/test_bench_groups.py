"""bench/groups.py: a generation's process groups made, in a new process and in process."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import groups  # noqa: E402


def test_the_layout_takes_pp_then_tp_then_dp():
    assert [(d.pp, d.dp, d.tp) for d in map(groups.layout, (2, 4, 8, 16))] == [
        (1, 2, 1), (1, 2, 2), (2, 2, 2), (2, 4, 2)]


def test_each_generation_makes_the_layouts_groups_again(tmp_path, capsys):
    """Two generations in the same four processes: the second (an in-process restart's) makes
    as many groups as the first, on a new port, the first's destroyed; every part is timed."""
    out = tmp_path / "groups.json"
    results = groups.main(["--worlds", "4", "--trials", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == results
    first, again = results["4"]
    # pp, edp and tp (dp and shard are edp here; experts, context and replicas span one rank)
    assert first["count"] == again["count"] == 3
    for row in (first, again):
        assert all(row[part] > 0 for part in groups.PARTS), row
        assert row["per_group"] == pytest.approx(row["groups"] / 3)
        assert row["ratio"] == pytest.approx((row["world"] + row["groups"]) / row["kept"])
    table = capsys.readouterr().out
    assert "| 4 | pp1 dp2 tp2 | new process |" in table
    assert "| 4 | pp1 dp2 tp2 | in process |" in table


@pytest.mark.parametrize("argv", [["--worlds", "3"], ["--worlds", "x"], ["--trials", "0"]])
def test_bad_arguments_are_refused_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as e:
        groups.main(argv)
    assert e.value.code == 2 and "--" in capsys.readouterr().err

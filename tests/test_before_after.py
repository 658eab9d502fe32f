"""benchmarks/before_after.py's bookkeeping: the figure is the median of the rounds' own after/before ratios with
their min-max (computed here by hand from set rates), a change in accepted tokens is reported as a behaviour change,
and bad input is one line before any run starts."""
from __future__ import annotations

import pytest

from conftest import benchmark_script

ba = benchmark_script("before_after")


def side(spec, base, accepted=100):
    return {"speculation_tokens_per_s": spec, "speculation_tokens_per_s_first_done": spec * 1.2,
            "baseline_tokens_per_s": base, "speedup": spec / base, "speedup_first_done": 1.2 * spec / base,
            "accepted_tokens": accepted}


def test_summary_is_the_median_of_the_rounds_ratios():
    rounds = [{"before": side(100, 50), "after": side(103, 50)},  # speculation ratios 1.03, 0.90, 1.01
              {"before": side(100, 40), "after": side(90, 48)},
              {"before": side(200, 50), "after": side(202, 45)}]
    s = ba.summary(rounds)
    assert s["speculation_tokens_per_s_ratio"]["median"] == pytest.approx(1.01)
    assert (s["speculation_tokens_per_s_ratio"]["min"], s["speculation_tokens_per_s_ratio"]["max"]) == pytest.approx((0.90, 1.03))
    assert s["baseline_tokens_per_s_ratio"]["median"] == pytest.approx(1.0)  # 1.0, 1.2, 0.9
    # a ratio of medians would differ: median(after)/median(before) = 103/100
    assert s["speedup_ratio"]["median"] == pytest.approx(sorted([1.03, 0.90 * 40 / 48, 1.01 * 50 / 45])[1])
    assert s["same_acceptance"]
    rounds[1]["after"]["accepted_tokens"] = 99
    assert not ba.summary(rounds)["same_acceptance"]


@pytest.mark.parametrize("args, says", [
    (["--rounds", "2"], "at least 3 rounds"),
    (["--points", "nowhere"], "unknown point nowhere"),
])
def test_bad_input_is_one_line(tmp_path, capsys, args, says):
    before = tmp_path / "old" / "magicdec"
    before.mkdir(parents=True)
    (before / "__main__.py").write_text("")
    assert ba.main(["--before", str(before.parent), "--output", str(tmp_path / "o.json"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_a_folder_without_the_package_is_refused(tmp_path, capsys):
    assert ba.main(["--before", str(tmp_path), "--output", str(tmp_path / "o.json")]) == 2
    assert "holds no magicdec package" in capsys.readouterr().err

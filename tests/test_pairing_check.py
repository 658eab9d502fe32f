"""benchmarks/planner/pairing_check.py on a tiny random Llama on the CPU: every decoder of a group is timed in the same
rounds (one run each per round), the greedy speculative ones give exactly the baseline's tokens, and the paired
ratios are the medians of the per-round ratios to decoder A."""
import json
import statistics

import pytest

from conftest import TINY_SWEEP, benchmark_script

pairing_check = benchmark_script("planner/pairing_check")

CONFIG = TINY_SWEEP + """
gammas = [1, 2]
methods = ["baseline", "selfspec", "auto"]
"""


def test_pairing_check_times_all_decoders_in_the_same_rounds(tmp_path):
    config = tmp_path / "sweep.toml"
    config.write_text(CONFIG)
    out = tmp_path / "check.json"
    pairing_check.main([str(config), str(tmp_path / "records"), "--group", "48:2:greedy:24/1,24/2",
                        "--repeats", "3", "--min_seconds", "0", "--skip_tokens", "0", "100", "--output", str(out)])
    check, again = json.loads(out.read_text())["checks"]
    assert (check["skip_tokens"], again["skip_tokens"]) == (0, 100)  # the group once per prompt offset
    decoders = check["decoders"]
    assert list(decoders) == ["A", "auto", "b24 g1", "b24 g2", "A2"] and check["rounds"] == 3
    a = decoders["A"]["round_s"]
    for name, d in decoders.items():
        assert d["same_tokens_as_A"], name
        assert len(d["round_s"]) == 3 and d["median_s"] == sorted(d["round_s"])[1]
        assert d["paired_vs_A"] == statistics.median(x / y for x, y in zip(a, d["round_s"]))
    assert decoders["A"]["paired_vs_A"] == 1.0 and decoders["b24 g2"]["gamma_use"] is None
    assert sum(decoders["auto"]["gamma_use"].values()) > 0  # the policy chose (and recorded) every verification
    for name, d in decoders.items():  # each timed run's seconds per iteration, beside the profiled costs
        assert d["seconds_per_iteration"] == pytest.approx(d["median_s"] / d["iterations"]) and d["iterations"] > 0
    assert set(check["profiled_seconds_per_verification"]) == set(check["profiled_again"]) == {"0", "1", "2"}


@pytest.mark.parametrize("group,needle", [("4096:1", "use PREFIX:B:MODE"), ("4096:1:beam", "use PREFIX:B:MODE"),
                                          ("4096:1:greedy:1024-1", "use PREFIX:B:MODE"),
                                          ("1024:1:greedy:1024/1", "0 < budget < prefix (1024)"),
                                          ("1024:1:greedy:256/0", "gamma >= 1")])
def test_bad_group_is_one_line(tmp_path, capsys, group, needle):
    with pytest.raises(SystemExit) as e:
        pairing_check.main(["cfg.toml", str(tmp_path), "--group", group, "--output", str(tmp_path / "o.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and needle in err[-1] and "Traceback" not in "\n".join(err)

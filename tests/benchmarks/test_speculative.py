"""Smoke test of `python -m benchmarks.speculative --server`, end to end (the generation benchmark's quick run takes
about a minute here: it runs by hand)."""

from __future__ import annotations

import json

from benchmarks.speculative import main


def test_quick_server_run_gives_the_plain_servers_tokens(tmp_path, capsys):
    assert main(["--server", "--quick", "--batch-sizes", "2", "--out-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    result = json.loads((tmp_path / "speculative_server.json").read_text())
    assert result["compiles_while_timed"] == 0 and result["config"]["batch_size"] == 2
    assert {(r["workload"], r["contender"]) for r in result["rows"]} == {
        (w, c) for w in ("copy-heavy", "random") for c in ("server_plain", "server_prompt_lookup")}
    assert all(r["agreement"] == 1.0 and r["whole_s"] > 0 for r in result["rows"])

"""Tuned config tables (configs/<arch>.json, `perf tune`; issue 19 item 5): checked once when
loaded. An unusable entry is dropped with one warning naming the file, the entry and why
(the defaults serve it); a file that is not JSON is ignored with a warning; shipped tables
pass; `perf tune` writes atomically."""
from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch

from triton_dilated.ops.common import configs
from triton_dilated.perf import tune

GOOD = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


class _Text:
    def __init__(self, text):
        self.text = text

    def read_text(self):
        return self.text

    def __str__(self):
        return "/site-packages/triton_dilated/configs/sm90.json"


@pytest.fixture
def table_text(monkeypatch):
    """Serve configs/sm90.json from a string; load_arch_table's cache is cleared around it."""
    def load(text):
        configs.load_arch_table.cache_clear()
        monkeypatch.setattr(configs, "tuned_table_path", lambda arch_name: _Text(text))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            table = configs.load_arch_table("sm90")
        return table, [str(w.message) for w in caught]
    yield load
    configs.load_arch_table.cache_clear()


def _entry(cfg, family="dilated_fwd", key="bfloat16/d128/n8192"):
    return json.dumps({"arch": "sm90", "tuned": True, "kernels": {family: {key: cfg}}})


BAD = {
    "BLOCK_M 48": (dict(GOOD, BLOCK_M=48), "BLOCK_M must be a power of two in [16, 256], got 48"),
    "BLOCK_M 64.0": (dict(GOOD, BLOCK_M=64.0), "BLOCK_M must be an int, got 64.0"),
    "BLOCK_M '64'": (dict(GOOD, BLOCK_M="64"), "BLOCK_M must be an int, got '64'"),
    "BLOCK_M -64": (dict(GOOD, BLOCK_M=-64), "BLOCK_M must be a power of two in [16, 256], got -64"),
    "BLOCK_M 0": (dict(GOOD, BLOCK_M=0), "BLOCK_M must be a power of two in [16, 256], got 0"),
    "BLOCK_N 4096": (dict(GOOD, BLOCK_N=4096), "BLOCK_N must be a power of two in [16, 256], got 4096"),
    "bool warps": (dict(GOOD, num_warps=True), "num_warps must be an int, got True"),
    "warps 3": (dict(GOOD, num_warps=3), "num_warps must be one of [1, 2, 4, 8, 16], got 3"),
    "stages 0": (dict(GOOD, num_stages=0), "num_stages must be in [1, 8], got 0"),
    "missing BLOCK_N": ({k: v for k, v in GOOD.items() if k != "BLOCK_N"}, "missing BLOCK_N"),
    "unknown key": (dict(GOOD, BLOCK_K=32), "unknown key 'BLOCK_K'"),
    "bad switch": (dict(GOOD, FLAT_LOOP=2), "FLAT_LOOP must be one of [1, 0], got 2"),
    "list entry": ([128, 64, 8, 3], "must be an object of BLOCK_M, BLOCK_N, num_warps, num_stages, got list"),
    "too big for sm90": (dict(GOOD, BLOCK_M=256, BLOCK_N=256, num_stages=8), "needs more shared memory than sm90's"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_entry_is_dropped_with_its_file_key_and_reason(table_text, name):
    cfg, reason = BAD[name]
    table, caught = table_text(_entry(cfg))
    assert table["kernels"] == {}
    assert len(caught) == 1, caught
    assert "/configs/sm90.json" in caught[0] and "kernels['dilated_fwd']['bfloat16/d128/n8192']" in caught[0]
    assert reason in caught[0], caught[0]


@pytest.mark.parametrize("text, reason", [
    (_entry(GOOD)[:60], "not valid JSON"),
    (json.dumps({"arch": "sm90", "kernels": ["dilated_fwd"]}), 'must be an object with a "kernels" object'),
    (json.dumps(["sm90"]), 'must be an object with a "kernels" object, got list'),
    (_entry(GOOD, key="bfloat16/d128/nabc"), "key 'bfloat16/d128/nabc' is not"),
    (_entry(GOOD, key="bf16/d128/n8192"), "key 'bf16/d128/n8192' is not"),
    (_entry(GOOD, family="dilated_forward"), "unknown kernel family 'dilated_forward'"),
], ids=["truncated", "kernels-list", "table-list", "bucket", "dtype", "family"])
def test_broken_file_parts_are_ignored_with_one_warning(table_text, text, reason):
    table, caught = table_text(text)
    assert table.get("kernels", {}) == {}
    assert len(caught) == 1 and reason in caught[0] and "/configs/sm90.json" in caught[0], caught


def test_good_entries_are_kept_beside_bad_ones(table_text, monkeypatch):
    text = json.dumps({"arch": "sm90", "kernels": {
        "dilated_fwd": {"bfloat16/d128/n8192": dict(GOOD, FLAT_LOOP=0), "bfloat16/d64/n8192": dict(GOOD, BLOCK_M=0)}}})
    table, caught = table_text(text)
    assert table["kernels"] == {"dilated_fwd": {"bfloat16/d128/n8192": dict(GOOD, FLAT_LOOP=0)}}
    assert len(caught) == 1 and "bfloat16/d64/n8192" in caught[0] and "1 unusable" in caught[0]
    # and selection uses it (a faked sm90 device)
    monkeypatch.setattr(configs, "device_arch", lambda device: configs.fake_arch("sm90"))
    got = configs.select_config("dilated_fwd", torch.bfloat16, 128, 8192, torch.device("cuda", 0))
    assert got == dict(GOOD, FLAT_LOOP=0)
    got = configs.select_config("dilated_fwd", torch.bfloat16, 64, 8192, torch.device("cuda", 0))
    assert got == configs.default_config("dilated_fwd", 64, configs.fake_arch("sm90"), torch.bfloat16)


def test_dkdv_kernel_takes_an_entry_of_its_own(table_text, monkeypatch):
    """A family entry tunes the family's dQ kernel; its dK/dV kernel (other tiles: keys x
    queries) takes an entry under its own name (configs.TUNED_KERNELS), else its default.
    A dK/dV entry is checked like a family's, without the family's switches."""
    dq, dkdv = dict(GOOD, BLOCK_M=64, num_stages=2), dict(GOOD, BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    key = "bfloat16/d128/n32768"
    table, caught = table_text(json.dumps({"arch": "sm90", "kernels": {
        "dilated_bwd": {key: dq}, "dilated_bwd_dkdv": {key: dkdv, "bfloat16/d64/n8192": dict(dkdv, FLAT_LOOP=0)},
        "block_sparse_bwd_dkdv": {key: dkdv}}}))
    assert table["kernels"]["dilated_bwd_dkdv"] == {key: dkdv}
    assert len(caught) == 1 and "unknown key 'FLAT_LOOP'" in caught[0], caught
    monkeypatch.setattr(configs, "device_arch", lambda device: configs.fake_arch("sm90"))
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16
    assert configs.select_config("dilated_bwd", bf16, 128, 32768, cuda) == dq
    assert configs.select_config("dilated_bwd", bf16, 128, 1 << 16, cuda, kernel="dilated_bwd_dkdv") == dkdv
    assert configs.select_config("block_sparse_bwd", bf16, 128, 4096, cuda, kernel="block_sparse_bwd_dkdv") == dkdv
    # no entry of its own: the kernel's default, not the family's entry
    assert configs.select_config("ring_step_bwd", bf16, 128, 4096, cuda, kernel="ring_step_bwd_dkdv") == \
        configs.default_config("ring_step_bwd", 128, configs.fake_arch("sm90"), bf16, "ring_step_bwd_dkdv")


def test_shipped_tables_pass():
    import triton_dilated.configs as tables   # the data package
    folder = os.path.dirname(tables.__file__)
    names = [f[:-5] for f in os.listdir(folder) if f.endswith(".json")]
    assert names
    for name in names:
        with open(os.path.join(folder, f"{name}.json")) as f:
            table = json.load(f)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert configs.validate_table(table, name, name)["kernels"] == table["kernels"]


def test_tune_writes_atomically(tmp_path, monkeypatch):
    """A write that fails midway leaves the previous file whole (temp file, then os.replace)."""
    path = tmp_path / "sm90.json"
    tune._write_json({"arch": "sm90", "kernels": {}}, str(path))
    before = path.read_text()

    def fail(obj, f, **kw):
        f.write('{"arch": "sm90", "kern')
        raise OSError("disk full")
    monkeypatch.setattr(tune.json, "dump", fail)
    with pytest.raises(OSError, match="disk full"):
        tune._write_json({"arch": "sm90", "kernels": {"x": {}}}, str(path))
    assert path.read_text() == before and sorted(os.listdir(tmp_path)) == ["sm90.json"]


@pytest.mark.parametrize("text, why", [
    ('{"arch": "sm90", "kernels": {"dilated_fwd": {"bfloat16/d', "not valid JSON"),
    ("[1, 2]", "must be a JSON object (a table), got list"),
    ('{"arch": "sm80", "kernels": {}}', "is the table of 'sm80', not of this GPU's arch 'sm90'"),
    (_entry(dict(GOOD, BLOCK_M=48)), "BLOCK_M must be a power of two"),
])
def test_tune_refuses_a_broken_out_file(tmp_path, text, why):
    """Hardening round 3 (open since round 2): `perf tune --out DIR` took a corrupt DIR/<arch>.json
    with a warning at most and overwrote it; now it stops first, naming the file and why, and
    the file is left as it was. A whole file is read as before."""
    (tmp_path / "sm90.json").write_text(text)
    with pytest.raises(RuntimeError, match=f"sm90.json: .*{re.escape(why)}.*would overwrite it"):
        tune.load_table("sm90", str(tmp_path))
    assert (tmp_path / "sm90.json").read_text() == text
    (tmp_path / "sm90.json").write_text(_entry(GOOD))
    assert tune.load_table("sm90", str(tmp_path))["kernels"] == {"dilated_fwd": {"bfloat16/d128/n8192": GOOD}}

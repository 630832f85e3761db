"""The consolidated checkpoint written stage by stage is the file ``torch.save`` writes with every tensor in hand."""

import pytest
import torch

from lightning_pipe.lightning.streamed import save_streamed


def _checkpoint():
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    remote = {("stage1", "w"): torch.randn(3, 5), ("stage1", "b"): torch.randn(5).to(torch.bfloat16),
              ("stage2", "w"): torch.randn(2, 2, 2)}
    placeholders = {key: torch.empty_like(t, device="meta") for key, t in remote.items()}
    checkpoint = {
        "epoch": 3, "state_dict": {"local.w": base, "local.view": base[2:4, 1:3], "local.shared": base,
                                   "s1.w": placeholders["stage1", "w"], "s2.w": placeholders["stage2", "w"],
                                   "s1.b": placeholders["stage1", "b"]},
        "optimizer_states": [{"state": {0: {"exp_avg": placeholders["stage2", "w"], "step": torch.tensor(7.0)}}}],
    }
    expected = {**checkpoint, "state_dict": {**checkpoint["state_dict"], "s1.w": remote["stage1", "w"],
                                             "s2.w": remote["stage2", "w"], "s1.b": remote["stage1", "b"]},
                "optimizer_states": [{"state": {0: {"exp_avg": remote["stage2", "w"], "step": torch.tensor(7.0)}}}]}
    lazy = {id(t): key for key, t in placeholders.items()}
    return checkpoint, expected, lazy, remote


def test_a_streamed_file_loads_as_torch_saves_with_every_group_fetched_once_in_order(tmp_path):
    checkpoint, expected, lazy, remote = _checkpoint()
    calls = []

    def fetch(group, keys):
        calls.append((group, sorted(keys)))
        return {key: remote[group, key] for key in keys}

    save_streamed(checkpoint, str(tmp_path / "streamed.pt"), lazy, fetch)
    torch.save(expected, tmp_path / "plain.pt")
    assert calls == [("stage1", ["b", "w"]), ("stage2", ["w"])]  # each group once, as they first appear
    for kwargs in ({"weights_only": True}, {"weights_only": True, "mmap": True}):
        mine, theirs = (torch.load(tmp_path / n, **kwargs) for n in ("streamed.pt", "plain.pt"))
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        assert mine["state_dict"]["s1.b"].dtype == torch.bfloat16
        # Storage sharing survives as torch.save keeps it: a view and an alias of one tensor stay one storage.
        sd = mine["state_dict"]
        assert sd["local.view"].untyped_storage().data_ptr() == sd["local.w"].untyped_storage().data_ptr()
        assert sd["local.shared"] is sd["local.w"] or sd["local.shared"].data_ptr() == sd["local.w"].data_ptr()
        # The same placeholder twice (a weight and its optimizer state would be distinct; here one tensor
        # appears in two places) is one record, as one tensor is in torch.save's file.
        assert mine["optimizer_states"][0]["state"][0]["exp_avg"].data_ptr() == sd["s2.w"].data_ptr()


def test_a_stage_whose_tensor_changed_shape_while_saving_is_named(tmp_path):
    checkpoint, _, lazy, remote = _checkpoint()
    with pytest.raises(RuntimeError, match=r"w of stage2 changed while saving \(expected \(2, 2, 2\)"):
        save_streamed(checkpoint, str(tmp_path / "x.pt"), lazy,
                      lambda group, keys: {k: remote[group, k].reshape(-1) if group == "stage2" else remote[group, k]
                                           for k in keys})


def test_a_meta_tensor_that_stands_for_nothing_is_refused(tmp_path):
    with pytest.raises(ValueError, match="meta device that stands for no stage's tensor"):
        save_streamed({"w": torch.empty(2, device="meta")}, str(tmp_path / "x.pt"), {}, lambda g, k: {})

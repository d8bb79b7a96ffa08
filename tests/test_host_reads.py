"""No step waits for the device but the steps that log (docs/performance.md): a step's loss stays a
tensor on the device, and the lines of metrics.jsonl wait, unread, until a log step, a checkpoint or
the run's end, where they are read in one copy. On the GPU, scripts/gpu_check.py proves it with
CUDA's sync debug mode; here a counting double stands for the device."""
import pytest
import torch

import launch


@pytest.mark.unit
def test_a_steps_loss_is_read_to_the_host_only_at_log_steps_checkpoints_and_the_end(tmp_path, tiny, monkeypatch):
    """8 steps, a line every 4, a checkpoint at step 6: with every tensor figure treated as one on an
    accelerator, the reducer's losses are never read one by one, and the lines are read in three
    batches (steps 1-4 at the log step, 5-6 before step 6's checkpoint, 7-8 at the end); the log is
    the one a CPU run writes line by line."""
    from run import metrics
    from runtime import reduce

    made, direct, batches = [], [], []  # the losses themselves (kept alive: an id is not reused)
    plain = reduce.DDPReduce.reduce

    def counted_reduce(self):
        loss = plain(self)
        assert isinstance(loss, torch.Tensor), f"the reducer read its loss to the host: {loss!r}"
        made.append(loss)
        return loss

    def reader(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if any(self is t for t in made):
                direct.append(name)
            return original(self, *args, **kwargs)
        return read

    host_values = metrics.host_values

    def batched(records):
        batches.append([r["step"] for r in records])
        return host_values(records)

    base = [*tiny, "train.steps=8", "checkpoint.interval=6", "log.progress=false"]
    assert launch.in_process(*base, f"out_dir={tmp_path / 'cpu'}")[0] == 0  # the CPU's way: every line at its step
    monkeypatch.setattr(reduce.DDPReduce, "reduce", counted_reduce)
    for name in ("item", "tolist", "__float__", "__format__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, reader(name))
    monkeypatch.setattr(metrics, "host_values", batched)
    monkeypatch.setattr(metrics, "on_device", lambda v: isinstance(v, torch.Tensor))  # as if on a GPU
    code, err = launch.in_process(*base, "log.every=4", f"out_dir={tmp_path / 'gpu'}")
    assert code == 0, err
    assert not direct, f"a step read its loss: {direct}"
    assert batches == [[1, 2, 3, 4], [5, 6], [7, 8]]
    launch.assert_identical(tmp_path / "gpu", tmp_path / "cpu")

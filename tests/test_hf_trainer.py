"""fastopt's optimizers in transformers' `Trainer` (through accelerate), the way a user plugs in an optimizer:
`Trainer(..., optimizers=(opt, scheduler))`, a checkpoint saved halfway, and `train(resume_from_checkpoint=...)`
in a fresh Trainer, model and optimizer. The resumed run must end with the same weights as the run that was never
interrupted, bit for bit: Trainer saves `optimizer.state_dict()` with torch.save and loads it back (weights only),
steps the scheduler, clips the gradients and accumulates micro-batches, so a state that does not round-trip
exactly (a step counter, an 8-bit absmax, GaLore's bases between two refreshes, a hyperparameter of a group)
shows as differing weights.

On CPU tensors (the plain-torch path; the kernels' state_dicts have the same keys and layout, checked by
test_checkpoint.py on both back ends). A tiny Llama (transformers' LlamaForCausalLM, no download) on random tokens.
"""
from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fastopt  # noqa: E402

STEPS, SAVE = 12, 6


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randint(0, 128, (96, 12), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


OPTIMIZERS = {
    "adafactor": lambda m: fastopt.Adafactor(m.parameters(), lr=1e-3, relative_step=False, scale_parameter=False,
                                             beta1=0.9, weight_decay=0.01),
    "came": lambda m: fastopt.CAME(m.parameters(), lr=1e-3, weight_decay=0.01),
    "came8": lambda m: fastopt.CAME(m.parameters(), lr=1e-3, nbits=8),
    "lamb": lambda m: fastopt.Lamb(m.parameters(), lr=1e-3, weight_decay=0.01),
    "lamb8": lambda m: fastopt.Lamb(m.parameters(), lr=1e-3, nbits=8, min_8bit_size=1024),
    # refreshes at steps 1, 5, 9: the checkpoint at 6 falls between two, so the bases must come back from it
    "galore": lambda m: fastopt.GaLoreAdamW(fastopt.get_galore_param_groups(m, weight_decay=0.01, rank=4,
                                                                            update_proj_gap=4), lr=1e-3),
    "galore8": lambda m: fastopt.GaLoreAdamW8bit(fastopt.get_galore_param_groups(m, weight_decay=0.01, rank=4,
                                                                                update_proj_gap=4), lr=1e-3,
                                                 min_8bit_size=256),
    "adamw8bit": lambda m: fastopt.AdamW8bit(m.parameters(), lr=1e-3, min_8bit_size=1024),
}


def _train(name, out, resume=None, accumulate=1, clip=0.0):
    model = _model()
    opt = OPTIMIZERS[name](model)
    sched = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_steps=SAVE, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate, max_grad_norm=clip, seed=42, data_seed=42, report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, logging_steps=STEPS, save_only_model=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    return model, opt, trainer


def _full_and_resumed(name, tmp_path, **kw):
    """The uninterrupted run and the one resumed from its checkpoint at SAVE, checked alike: both end at STEPS
    with the same lr, every weight trained, and the same weights bit for bit. Returns the first run's
    (optimizer, trainer)."""
    full, opt, trainer = _train(name, tmp_path / "full", **kw)
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "full" / f"checkpoint-{SAVE}", tmp_path / "resumed" / f"checkpoint-{SAVE}")
    resumed, _, again = _train(name, tmp_path / "resumed", resume=True, **kw)
    assert trainer.state.global_step == again.state.global_step == STEPS
    assert again.lr_scheduler.get_last_lr() == trainer.lr_scheduler.get_last_lr()
    init = _model().state_dict()
    a, b = full.state_dict(), resumed.state_dict()
    assert all(not torch.equal(a[k], init[k]) for k in a), "a weight did not train"
    differ = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not differ, f"resumed weights differ from the uninterrupted run's: {differ}"
    return opt, trainer


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_trainer_resumes_from_a_checkpoint_bit_for_bit(name, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    opt, _ = _full_and_resumed(name, tmp_path)
    eight = [s for s in opt.state.values() if any(t.dtype == torch.uint8 for t in s.values()
                                                    if isinstance(t, torch.Tensor))]
    assert bool(eight) == (name.endswith("8") or name == "adamw8bit"), "8-bit states as configured"


@pytest.mark.parametrize("name", ["came", "lamb8", "galore"])
def test_trainer_with_accumulation_and_clipping_resumes_bit_for_bit(name, tmp_path, monkeypatch):
    """gradient_accumulation_steps=2 and max_grad_norm (accelerate's clip_grad_norm_ over the params)."""
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    _, trainer = _full_and_resumed(name, tmp_path, accumulate=2, clip=0.5)
    assert any(h.get("grad_norm", 0) > 0.5 for h in trainer.state.log_history), "clipping never engaged"

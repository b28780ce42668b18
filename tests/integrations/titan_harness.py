"""Trains torchtitan's llama3 debug model on CPU gloo ranks (``tide.launch.run_ranks``), in-process,
through torchtitan's own config manager and ``Trainer``, with a command line that either goes through
``tide.torchtitan`` or not: one run per spawn (a second ``Trainer`` in one process fails in 0.3's
``fully_shard`` under the spmd_types backend, on another mesh).

The assets are made here: a word-level tokenizer (the ``tokenizers`` package) and seeded synthetic text
as the files of torchtitan's ``c4_test`` dataset. The CPU shims (:func:`cpu_shims`) are the harness's,
applied in every rank before torchtitan is imported: stock and TIDE runs differ only by the integration.
"""
from __future__ import annotations

import inspect
import json
import os
import random
from importlib import metadata
from types import SimpleNamespace

WORDS = 400
SPECIALS = ("<unk>", "<|begin_of_text|>", "<|end_of_text|>")


def torchtitan_minor() -> tuple[int, int]:
    major, minor = metadata.version("torchtitan").split(".")[:2]
    return int(major), int(minor)


def make_assets(root: str, seed: int = 0, docs: int = 200) -> tuple[str, str]:
    """A tokenizer folder and a dataset folder (``train.jsonl`` of ``{"text": ...}``) under ``root``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(WORDS)]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(words))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "data")
    os.makedirs(tok_dir), os.makedirs(data_dir)
    tokenizer.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": SPECIALS[1], "eos_token": SPECIALS[2]}, f)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        for _ in range(docs):
            # A Zipf-like draw, so that the model has something to learn in a few steps.
            text = " ".join(words[min(int(rng.paretovariate(1.0)) - 1, WORDS - 1)] for _ in range(rng.randint(20, 80)))
            f.write(json.dumps({"text": text}) + "\n")
    return tok_dir, data_dir


def cli_args(version: tuple[int, int], tide: bool, tok_dir: str, data_dir: str, out_dir: str, steps: int,
             seq_len: int = 64, spmd_backend: str = "partial_dtensor") -> list[str]:
    """torchtitan's command line for the llama3 debug model on 2 ranks, stock or through ``tide.torchtitan``
    (``spmd_backend``: 0.3's ``--parallelism.spmd_backend``). Parameters stay fp32 (bf16 matmuls make a
    step about 6x slower on CI's CPU); the reduce is fp32 either way, as TIDE's contract asks."""
    common = [f"--training.seq_len={seq_len}", "--training.local_batch_size=2", f"--training.steps={steps}",
              "--training.mixed_precision_param=float32", "--parallelism.data_parallel_shard_degree=2",
              "--metrics.log_freq=1", "--debug.seed=0", "--lr_scheduler.warmup_steps=1"]
    if version < (0, 3):
        model = ["--experimental.custom_import=tide.torchtitan", "--model.name=tide_llama3"] if tide else \
            ["--model.name=llama3"]
        return [*model, "--model.flavor=debugmodel", f"--model.hf_assets_path={tok_dir}",
                "--training.dataset=c4_test", f"--training.dataset_path={data_dir}", f"--job.dump_folder={out_dir}",
                *common]
    return ["--module", "tide.torchtitan" if tide else "llama3", "--config", "llama3_debugmodel",
            f"--hf_assets_path={tok_dir}", f"--dataloader.dataset_path={data_dir}", f"--dump_folder={out_dir}",
            f"--parallelism.spmd_backend={spmd_backend}", *common]


def cpu_shims() -> None:
    """What torchtitan needs to train on CPU over gloo (the same for stock and TIDE)."""
    import torch
    import torch._utils
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    # torchtitan takes "cuda" when torch finds no accelerator (tools/utils.py, at its import).
    available = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: available() or "cpu"
    # What its device memory monitor asks of the device module (torch.cpu has none of it).
    cpu_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name, fn in {"get_device_name": lambda device=None: "cpu",
                     "get_device_properties": lambda device=None: SimpleNamespace(name="cpu", total_memory=cpu_memory),
                     "reset_peak_memory_stats": lambda device=None: None, "empty_cache": lambda: None,
                     "memory_stats": lambda device=None: {}}.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)

    # Its barrier passes device_ids=[torch.cpu.current_device()], which is "cpu", not an index.
    barrier = dist.barrier

    def cpu_barrier(*args, device_ids=None, **kwargs):
        if device_ids is not None and not all(isinstance(d, int) for d in device_ids):
            device_ids = None
        return barrier(*args, device_ids=device_ids, **kwargs)

    dist.barrier = cpu_barrier

    # gloo has no PREMUL_SUM, which FSDP2 picks for torchtitan's gradient divide factor of 1.0: sum in
    # the collective and divide after (by 1.0: nothing), FSDP2's own force-sum branch.
    divide_factors = _fsdp_collectives._get_gradient_divide_factors
    signature = inspect.signature(divide_factors)

    def sum_reduction(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["force_sum_reduction_for_comms"] = True
        return divide_factors(*bound.args, **bound.kwargs)

    _fsdp_collectives._get_gradient_divide_factors = sum_reduction

    # 0.3's llama3 attends with FlexAttention (flex or varlen: no sdpa option), which has no backward on
    # CPU: the same masked attention through scaled_dot_product_attention, its mask from the block mask's
    # mask_mod. Its block masks come from a torch.compile'd create_block_mask, which inductor would
    # compile in every rank (C++ on CPU, ~10 s a run): eager create_block_mask builds the same masks.
    if torchtitan_minor() >= (0, 3):
        from torch.nn.attention.flex_attention import create_block_mask
        from torchtitan.models.common import attention

        attention.FlexAttention._compiled_flex_attn = staticmethod(_cpu_flex_attention)
        attention._compiled_create_block_mask = create_block_mask

        # The graph trainer's FSDP bucketing pass estimates runtimes by roofline; torch 2.14's estimator asks
        # triton for a GPU's DRAM bandwidth, which fails with no GPU. Infinite bandwidth: no transfer time,
        # what torch 2.15's estimator counts without an accelerator.
        from torch._inductor import utils as inductor_utils
        from torch.utils import _runtime_estimation

        if not hasattr(inductor_utils, "get_device_dram_gbps") and not torch.cuda.is_available():
            _runtime_estimation.get_gpu_dram_gbps = lambda: float("inf")


def _cpu_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None,
                        kernel_options=None):
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None or (return_aux is not None and (return_aux.lse or return_aux.max_scores)):
        raise NotImplementedError("the harness's CPU flex attention takes neither score_mod nor aux outputs")
    mask = None
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None


_METRICS: list = []


def _record_metrics() -> None:
    """Every step's (step, global mean loss, max local loss, gradient norm), as torchtitan logs them."""
    from torchtitan.components.metrics import MetricsProcessor

    log = MetricsProcessor.log
    if getattr(log, "__harness__", False):
        return

    def recording_log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        _METRICS.append((int(step), float(global_avg_loss), float(global_max_loss), float(grad_norm)))
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    recording_log.__harness__ = True
    MetricsProcessor.log = recording_log


def train(argv: list[str], inspect=None) -> dict:
    """One torchtitan training run in this rank, as ``python -m torchtitan.train argv`` trains (on the
    process group ``run_ranks`` made, which torchtitan keeps): its metrics and TIDE's FSDP2 counts, and
    ``inspect(trainer)`` after training, when given, under ``"inspect"``."""
    import tide
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    _record_metrics()
    _METRICS.clear()
    tide.reset_stats()
    config = ConfigManager().parse_args(argv)
    if torchtitan_minor() < (0, 3):
        from torchtitan.train import Trainer

        trainer = Trainer(config)
    else:
        trainer = config.build()
    try:
        trainer.train()
        inspected = inspect(trainer) if inspect is not None else None
    finally:
        trainer.close()
    return {"metrics": list(_METRICS), "fsdp": tide.stats()["fsdp"], "inspect": inspected}


def probe() -> dict:
    """What ``tide.torchtitan`` does besides training (run in a rank, which has torchtitan imported
    already): its option errors, a model without FSDP2 module, and its names for this torchtitan."""
    import logging

    import torch.nn as nn

    import tide.torchtitan as tt

    out = {}
    for var in (tt.RS_MODE_ENV, "TIDE_FSDP_TRANSPORT"):
        old = os.environ.get(var)
        os.environ[var] = "bogus"
        try:
            tt.options()
            out[var] = "no error"
        except ValueError as e:
            out[var] = str(e)
        finally:
            if old is None:
                del os.environ[var]
            else:
                os.environ[var] = old

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    tt.log.addHandler(handler)
    try:
        plain = nn.Linear(2, 2)
        returned = tt.wrap(lambda model, *args, **kwargs: model)(plain, "parallel_dims", job_config=None)
    finally:
        tt.log.removeHandler(handler)
    out["no_fsdp"] = {"same_model": returned is plain, "log": messages}

    if torchtitan_minor() < (0, 3):
        from torchtitan.protocols.train_spec import get_train_spec

        out["specs"] = {name: bool(getattr(get_train_spec(tt.PREFIX + name).parallelize_fn, "__tide__", False))
                        for name in ("llama3", "llama3_ft", "llama4", "qwen3", "gpt_oss", "deepseek_v3")}
    else:
        out["configs"] = {name: bool(getattr(getattr(tt, name)().model_spec.parallelize_fn, "__tide__", False))
                          for name in ("llama3_debugmodel", "llama3.llama3_8b", "qwen3_debugmodel",
                                       "torchtitan.models.llama3.config_registry.llama3_debugmodel")}
        out["unknown_config"] = getattr(tt, "no_such_config", None)
    return out


def rank_main(rank: int, world_size: int, argv: list[str], with_probe: bool = False) -> dict:
    """``tide.launch.run_ranks`` target: one training run, then :func:`probe` if asked."""
    import torch

    torch.set_num_threads(1)  # a core per rank: 2 ranks share the 2 cores of CI without oversubscription
    cpu_shims()
    result = train(argv)
    if with_probe:
        result["probe"] = probe()
    return result

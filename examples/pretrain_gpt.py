# Poseidon example: pre-train a GPT model with megatron-core 0.19 (the ">= core 0.18" script shape).
"""Pre-train a GPT model with Megatron's own argument handling and ``pretrain()``.

Written in the style of Megatron-LM's ``pretrain_gpt.py`` of the core 0.18/0.19 generation
(arguments are parsed, validated and frozen into config objects *before* ``pretrain``), small enough
to read in one sitting. Poseidon never edits it; run it either through the launcher::

    torchrun --nproc-per-node 8 -m poseidon_plugin.launch examples/pretrain_gpt.py <args> --poseidon-auto

or uncomment the one-line patch below and launch the script directly::

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py <args> --poseidon-auto

With ``--poseidon-emulate FILE`` the whole run (profiling, plan, training) happens on the CPU with
emulated device types (see ``examples/emulate-2types.yaml``).

``POSEIDON_EXAMPLE_REPORT=DIR`` (optional) makes every rank write ``DIR/rank<N>.json`` with its
pipeline stage, the decoder layer numbers it built and its per-iteration losses; the integration test
reads those files.
"""

# import poseidon_plugin.auto  # noqa: E402  <- the one-line patch (see patches/README.md)

import json
import os
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, inprocess_restart, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

_REPORT: dict = {"losses": [], "layer_numbers": []}


def _report_dir() -> str | None:
    return os.environ.get("POSEIDON_EXAMPLE_REPORT") or None


def _write_report() -> None:
    out = _report_dir()
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    rank = torch.distributed.get_rank()
    _REPORT.update(
        rank=rank,
        world_size=torch.distributed.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        launch_rank=int(os.environ.get("POSEIDON_LAUNCH_RANK", rank)),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device_type=os.environ.get("POSEIDON_DEVICE_TYPE", ""),
    )
    with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(_REPORT, f, indent=1, sort_keys=True)
    os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))


def _record_layers(model) -> None:
    """Remember which decoder layers this rank built (global 1-based layer numbers)."""
    decoder = getattr(get_attr_wrapped_model(model, "decoder", allow_none=True) or object(), "layers", [])
    numbers = [int(layer.layer_number) for layer in decoder]
    if numbers and numbers not in _REPORT["layer_numbers"]:
        _REPORT["layer_numbers"].append(numbers)


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage=None):
    """The next micro-batch on the first and last stages (None elsewhere).

    TP rank 0 reads it from the data iterator and broadcasts it to the other ranks of its TP group.
    """
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    assert args.context_parallel_size == 1, "this example does not split sequences (CP)"
    device = torch.cuda.current_device()
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = {k: (data[k].to(device, non_blocking=True) if data.get(k) is not None else None)
                 for k in _BATCH_KEYS}
    else:
        batch = dict.fromkeys(_BATCH_KEYS)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        shape = (args.micro_batch_size, args.seq_length)
        specs = {"tokens": (shape, torch.int64), "labels": (shape, torch.int64),
                 "loss_mask": (shape, torch.float32), "position_ids": (shape, torch.int64)}
        if args.create_attention_mask_in_dataloader:
            specs["attention_mask"] = ((args.micro_batch_size, 1, args.seq_length, args.seq_length),
                                       torch.bool)
        src = parallel_state.get_tensor_model_parallel_src_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        for key, (key_shape, dtype) in specs.items():
            if batch[key] is None:
                batch[key] = torch.empty(key_shape, dtype=dtype, device=device)
            torch.distributed.broadcast(batch[key], src, group=group)
    return tuple(batch[k] for k in _BATCH_KEYS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses, the token count, and the report Megatron averages across DP."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if _report_dir() is not None:
        _REPORT["losses"].append((loss.detach() / num_tokens.clamp(min=1)).item())
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """One micro-batch forward; returns the output and the loss function."""
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    if _report_dir() is not None:
        _record_layers(model)
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0


def dataset_config_from_args(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Build the train, validation and test datasets (mock data with --mock-data)."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        dataset_config_from_args(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    model_cfg = gpt_config_from_args(args)
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    try:
        pretrain(
            full_config,
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            store=store,
        )
    finally:
        if _report_dir() is not None and torch.distributed.is_initialized():
            _write_report()

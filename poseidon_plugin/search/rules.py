"""``FrameworkRules``: what the training framework refuses, as exclusions of the search space.

Megatron-LM's ``validate_args`` (and MindSpeed / MindSpeed-LLM's patched one) refuse some
parallel layouts outright, depending on the user's own flags. The ones knowable from the command
line enter the search before it starts, so no time is spent on a plan the framework refuses
(``FrameworkRules.from_argv``); the search's enumeration (``configs.enumerate_configs``) drops
every outer configuration a rule refuses, and names each excluded class once
(``interleaved-1f1b pp=2 excluded: Megatron requires pp > 2 with --no-overlap-p2p-communication``).
A configuration the installed framework refused at launch (rank 0 runs its parse + validate on
the rewritten command line: ``megatron/launch/judge.py``) is added with ``FrameworkRules.refuse`` and
the search runs again without it.

The rules, with where the framework says so (Megatron-LM core_v0.12.1, core_v0.15.3 and
core_v0.19.0 ``megatron/training/arguments.py``; MindSpeed 2.3.0 / 26.1.0 and MindSpeed-LLM
v2.3.0 / v26.1.0 ``features_manager``):

======================================== ===================================================
flag                                     excluded
======================================== ===================================================
``--no-overlap-p2p-communication``       interleaved with pp <= 2 (validate_args; MindSpeed's
                                         layout feature says the same)
``--overlap-param-gather-with-``         every non-interleaved schedule (validate_args:
``optimizer-step``                       "only supported with interleaved pipeline
                                         parallelism")
``--use-torch-fsdp2``                    pp > 1 (validate_args)
``--ckpt-format torch_dcp``              pp > 1 and tp > 1 (validate_args)
``--tp-comm-overlap``                    tp = 1 (validate_args turns sequence parallelism off
                                         at TP 1, then requires it)
``--distribute-saved-activations``       tp = 1 (validate_args)
``--microbatch-group-size-per-``         interleaved where G < pp, G > M or 0 < M mod G < pp
``virtual-pipeline-stage G``             (megatron-core's interleaved schedule, at the first
                                         step)
``--noop-layers``                        pp > 1 (MindSpeed-LLM drops ``--num-layer-list``
                                         with noop layers; the layout flag refuses them)
``--schedules-method dualpipev``         everything: dualpipev needs pp > 1 and takes neither
                                         ``--num-layer-list`` nor the layout flag
``--recompute-in-bubble`` / ``-advance`` interleaved (MindSpeed's layout feature)
``--optimize-send-recv-comm``            interleaved (MindSpeed's layout feature)
``--first-k-dense-replace K``            pp with num_layers // pp <= K (MindSpeed-LLM: no pp
                                         stage of dense layers only)
``--mtp-num-layers N``, ``--save``,      pp > 1 (megatron-core 0.12.1 / 0.15.3 / 0.19.0
tied embeddings, a distributed           allocate the last stage's output weight next to
``--ckpt-format``                        MTP's embedding copy, and its sharded_state_dict
                                         asserts there is none: the first save dies)
MoE layers without                       tp > 1 (megatron-core's MoE layer at TP > 1 needs
``--sequence-parallel``                  sequence parallelism in training; ``moe``: the
                                         model has MoE layers, or ``--num-experts`` > 0)
======================================== ===================================================

Pure Python (no torch): ``poseidon plan --megatron-args "..."`` applies the same rules offline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from ..errors import PoseidonError

INTERLEAVED = "interleaved-1f1b"

MOE_TP_REASON = ("megatron-core trains MoE layers at TP > 1 only with --sequence-parallel "
                 "(add it to plan TP > 1)")

# what a rule bounds (``Rule.kind``)
KINDS = ("interleaved_min_pp", "interleaved_only", "no_interleaving", "min_pp", "max_pp",
         "min_tp", "max_tp", "microbatch_group", "refused")


class Shape(NamedTuple):
    """What a framework rule can see of a plan or an outer configuration (tp 0: per-stage)."""

    schedule: str
    virtual_stages: int
    pp: int
    tp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int

    @classmethod
    def of_config(cls, cfg: Any) -> "Shape":
        return cls(cfg.schedule, cfg.virtual_stages, cfg.num_stages, cfg.tp, cfg.dp,
                   cfg.micro_batch_size, cfg.num_microbatches)

    @classmethod
    def of_plan(cls, plan: Any) -> "Shape":
        tp = plan.stages[0].tp if plan.uniform_tp else 0
        return cls(plan.schedule, plan.virtual_stages, plan.pp, tp, plan.dp,
                   plan.micro_batch_size, plan.num_microbatches)

    @property
    def interleaved(self) -> bool:
        return self.schedule == INTERLEAVED and self.virtual_stages > 1

    def describe(self) -> str:
        """``interleaved-1f1b V=2 pp=2 tp=1 dp=1 mbs=1``: one configuration."""
        v = f" V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        tp = self.tp if self.tp else "per-stage"
        return (f"{self.schedule}{v} pp={self.pp} tp={tp} dp={self.dp} "
                f"mbs={self.micro_batch_size}")


@dataclass(frozen=True)
class Rule:
    """One refusal of the framework: ``kind`` (``KINDS``) with its bound ``value`` (and, for
    ``refused``, the one configuration ``shape``), and why, in one line."""

    kind: str
    value: int
    reason: str
    shape: Shape | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PoseidonError(f"framework rule: unknown kind {self.kind!r}")
        if self.kind == "refused" and self.shape is None:
            raise PoseidonError("framework rule 'refused' needs the configuration's shape")

    def refuses_tp(self, t: int) -> bool:
        """Whether this rule refuses TP degree ``t`` whatever the rest of the plan."""
        return ((self.kind == "min_tp" and t < self.value)
                or (self.kind == "max_tp" and t > self.value))

    def label(self, s: Shape) -> str | None:
        """The class of ``s`` this rule excludes (``interleaved-1f1b pp=2``), None if it does
        not exclude ``s``."""
        k, v = self.kind, self.value
        if k == "interleaved_min_pp":
            return f"{INTERLEAVED} pp={s.pp}" if s.interleaved and s.pp < v else None
        if k == "interleaved_only":
            return s.schedule if not s.interleaved else None
        if k == "no_interleaving":
            return INTERLEAVED if s.interleaved else None
        if k == "min_pp":
            return _bound_label("pp", "<", v) if s.pp < v else None
        if k == "max_pp":
            return _bound_label("pp", ">", v) if s.pp > v else None
        if k in ("min_tp", "max_tp"):
            if not s.tp or not self.refuses_tp(s.tp):
                return None
            return _bound_label("tp", "<" if k == "min_tp" else ">", v)
        if k == "microbatch_group":
            if s.interleaved and not _group_ok(v, s.pp, s.num_microbatches):
                return f"{INTERLEAVED} pp={s.pp} with {s.num_microbatches} micro-batches"
            return None
        # refused: this one configuration
        assert self.shape is not None
        return s.describe() if s == self.shape else None


def _bound_label(name: str, op: str, value: int) -> str:
    """``pp=1`` (below 2), ``pp < 4``, ``tp > 1``: the class a bound excludes."""
    if op == "<":
        return f"{name}=1" if value == 2 else f"{name} < {value}"
    return f"{name} > {value}"


def _group_ok(g: int, n: int, m: int) -> bool:
    """megatron-core's interleaved schedule with micro-batch group size g: g in [N, M] and the
    last group empty or at least N micro-batches."""
    return n <= g <= m and not 0 < m % g < n


@dataclass(frozen=True)
class FrameworkRules:
    """The framework's refusals a search honours (``SearchOptions.rules``); empty: none."""

    rules: tuple[Rule, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        for r in self.rules:
            if not isinstance(r, Rule):
                raise PoseidonError(f"framework rules: expected Rule values, got {r!r}")

    def __bool__(self) -> bool:
        return bool(self.rules)

    # ------------------------------------------------------------------ from the command line
    @classmethod
    def from_argv(cls, argv: Sequence[str], num_layers: int | None = None,
                  moe: bool = False) -> "FrameworkRules":
        """The rules the user's Megatron-LM / MindSpeed-LLM flags imply (the table of the module
        docstring). ``num_layers``: the model's decoder layers (default: ``--num-layers``);
        ``moe``: the model has MoE layers (also read from ``--num-experts``)."""
        from poseidon_plugin.megatron.launch.argv import find_flag, flag_value

        argv = list(argv)
        out: list[Rule] = []

        def add(kind: str, value: int, reason: str) -> None:
            out.append(Rule(kind, value, reason))

        if find_flag(argv, "--no-overlap-p2p-communication"):
            add("interleaved_min_pp", 3,
                "Megatron requires pp > 2 with --no-overlap-p2p-communication")
        if find_flag(argv, "--overlap-param-gather-with-optimizer-step"):
            add("interleaved_only", 1, "Megatron supports --overlap-param-gather-with-"
                "optimizer-step only with interleaved pipeline parallelism")
        if find_flag(argv, "--use-torch-fsdp2"):
            add("max_pp", 1, "Megatron does not support --use-torch-fsdp2 with pipeline "
                "parallelism")
        if flag_value(argv, "--ckpt-format") == "torch_dcp":
            add("max_pp", 1, "Megatron refuses --ckpt-format torch_dcp with pipeline "
                "parallelism")
            add("max_tp", 1, "Megatron refuses --ckpt-format torch_dcp with tensor "
                "parallelism")
        if find_flag(argv, "--tp-comm-overlap"):
            add("min_tp", 2, "Megatron's --tp-comm-overlap needs sequence parallelism, which "
                "it turns off at tp=1")
        if find_flag(argv, "--distribute-saved-activations"):
            add("min_tp", 2, "Megatron distributes saved activations (--distribute-saved-"
                "activations) only over tp > 1")
        group = flag_value(argv, "--microbatch-group-size-per-virtual-pipeline-stage")
        if group is not None:
            g = _int_flag("--microbatch-group-size-per-virtual-pipeline-stage", group)
            add("microbatch_group", g, f"megatron-core's interleaved schedule needs the "
                f"micro-batch group size {g} (--microbatch-group-size-per-virtual-pipeline-"
                f"stage) within [pp, M] and M mod {g} either 0 or >= pp")
        # MindSpeed / MindSpeed-LLM
        if find_flag(argv, "--noop-layers"):
            add("max_pp", 1, "MindSpeed-LLM cannot split the layers unevenly with --noop-layers "
                "(it drops --num-layer-list; the layout flag refuses it)")
        if flag_value(argv, "--schedules-method") == "dualpipev":
            add("min_pp", 2, "MindSpeed's dualpipev schedule requires pp > 1")
            add("max_pp", 1, "MindSpeed's dualpipev schedule takes neither --num-layer-list "
                "nor --pipeline-model-parallel-layout (remove --schedules-method dualpipev to "
                "let Poseidon split the layers)")
        for switch in ("--recompute-in-bubble", "--recompute-in-advance"):
            if find_flag(argv, switch):
                add("no_interleaving", 1, f"MindSpeed refuses {switch} with "
                    "--pipeline-model-parallel-layout")
        if find_flag(argv, "--optimize-send-recv-comm"):
            add("no_interleaving", 1, "MindSpeed refuses --optimize-send-recv-comm with an "
                "interleaved --pipeline-model-parallel-layout")
        dense = flag_value(argv, "--first-k-dense-replace")
        if dense is not None:
            k = _int_flag("--first-k-dense-replace", dense)
            layers = num_layers
            if layers is None and flag_value(argv, "--num-layers") is not None:
                layers = _int_flag("--num-layers", flag_value(argv, "--num-layers"))
            if layers is not None and k > 0:
                add("max_pp", layers // (k + 1), f"MindSpeed-LLM refuses a pp stage of dense "
                    f"layers only (--first-k-dense-replace {k}: num_layers // pp must exceed "
                    f"{k})")
        mtp = flag_value(argv, "--mtp-num-layers")
        if (mtp is not None and _int_flag("--mtp-num-layers", mtp) > 0
                and find_flag(argv, "--save")
                and not find_flag(argv, "--untie-embeddings-and-output-weights")
                and flag_value(argv, "--ckpt-format", "torch_dist") != "torch"):
            add("max_pp", 1, "megatron-core cannot save an MTP model with tied embeddings at "
                "pp > 1 (LanguageModule.tie_embeddings_and_output_weights_state_dict asserts on "
                "the last stage's output weight at the first save): add --untie-embeddings-"
                "and-output-weights to plan pp > 1")
        experts = flag_value(argv, "--num-experts")
        if experts is not None and _int_flag("--num-experts", experts) > 0:
            moe = True
        if moe and not find_flag(argv, "--sequence-parallel"):
            add("max_tp", 1, MOE_TP_REASON)
        return cls(tuple(out))

    # ------------------------------------------------------------------ refusals at launch
    def refuse(self, shape: Shape, reason: str) -> "FrameworkRules":
        """These rules and one more: the configuration ``shape``, refused for ``reason``."""
        return FrameworkRules(self.rules + (Rule("refused", 0, reason, shape),))

    @property
    def refused(self) -> tuple[Rule, ...]:
        return tuple(r for r in self.rules if r.kind == "refused")

    # ------------------------------------------------------------------ queries
    def tp_allowed(self, t: int) -> bool:
        return not any(r.refuses_tp(t) for r in self.rules)

    def violation(self, s: Shape) -> tuple[str, Rule] | None:
        """(the excluded class, the rule) of the first rule refusing ``s``; None: allowed."""
        for r in self.rules:
            label = r.label(s)
            if label is not None:
                return label, r
        return None

    def allows(self, s: Shape) -> bool:
        return self.violation(s) is None

    def tp_lines(self, tps: Sequence[int]) -> list[str]:
        """One line per TP degree of ``tps`` a rule refuses."""
        out = []
        for t in sorted(set(tps)):
            for r in self.rules:
                if r.refuses_tp(t):
                    out.append(f"tp={t} excluded: {r.reason}")
                    break
        return out


def excluded_line(label: str, rule: Rule) -> str:
    """``interleaved-1f1b pp=2 excluded: Megatron requires pp > 2 with ...``"""
    return f"{label} excluded: {rule.reason}"


def _int_flag(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise PoseidonError(f"{flag}: expected an integer, got {text!r}") from None




# ----------------------------------------------------------------------------------------------
# a pipeline stage without MoE layers (megatron-core before 0.19)
# ----------------------------------------------------------------------------------------------

# megatron-core 0.12.1 (MindSpeed-LLM's base) builds the experts' optimizer only on ranks that
# hold expert parameters, and ChainedOptimizer.get_grad_norm then reduces that optimizer's
# gradient norm over the expert tensor x model x pipeline group: the ranks of a stage with
# no MoE layer never join, and every rank waits at the first optimizer step (seen under the
# emulation on MindSpeed-LLM v26.1.0 with the layout Et|t*3mL; megatron-core 0.19.2 trains it)
MOE_FREE_STAGE_FIXED_IN = (0, 19)


def stages_without_moe_layers(plan: Any, model: Any) -> list[tuple[int, list[int]]]:
    """(stage, its 1-based decoder layers) of each pipeline stage of ``plan`` that holds no
    MoE layer of ``model`` while another stage holds some; [] when every stage holds one, the
    model has no MoE layer, or the plan has one stage. A stage's layers are those of all its
    virtual chunks (one optimizer per rank)."""
    kinds = getattr(model, "layer_kinds", ())
    kind_of = getattr(model, "layer_kind_of", ())
    pp = plan.pp
    if pp <= 1 or not kinds or len(kind_of) != sum(s.layers for s in plan.stages):
        return []
    moe = [kinds[k].is_moe for k in kind_of]
    if not any(moe):
        return []
    segs = plan.layout_segments()   # chunk-major: index c * pp + s
    held: list[list[int]] = [[] for _ in range(pp)]
    first = 0
    for k, n in enumerate(segs):
        held[k % pp].extend(range(first, first + n))
        first += n
    return [(s, [i + 1 for i in layers]) for s, layers in enumerate(held)
            if not any(moe[i] for i in layers)]


def moe_free_stage_refusal(plan: Any, model: Any, framework: str,
                           version: tuple[int, ...] | None) -> str | None:
    """Why ``framework`` (its megatron-core ``version``; None: unknown, judged as the old one)
    would hang on ``plan`` (one line), or None. See ``MOE_FREE_STAGE_FIXED_IN``."""
    if version is not None and tuple(version[:2]) >= MOE_FREE_STAGE_FIXED_IN:
        return None
    bare = stages_without_moe_layers(plan, model)
    if not bare:
        return None
    s, layers = bare[0]
    span = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
    return (f"stage {s} holds no MoE layer ({span}: dense); {framework} hangs at the first "
            "optimizer step when a pipeline stage has no expert parameters (its experts' "
            "optimizer reduces the gradient norm over every stage)")


def version_tuple(text: str) -> tuple[int, ...] | None:
    """``0.12.1`` / ``0.19.2rc0`` -> (0, 12, 1) / (0, 19, 2); None when it names no version."""
    import re

    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


__all__ = ["FrameworkRules", "Rule", "Shape", "excluded_line", "MOE_FREE_STAGE_FIXED_IN",
           "moe_free_stage_refusal", "stages_without_moe_layers", "version_tuple"]

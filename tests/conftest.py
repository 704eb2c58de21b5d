"""Test-wide settings. Hypothesis: no per-example deadline and no too-slow health check -- CI
hosts are loaded, and a test asserts behaviour, never wall time.

Tiers: ``make test`` runs ``-m "not slow"``, ``make test-slow`` runs ``-m slow`` (CI runs both).
A test is slow when it is marked so in its file or listed in ``SLOW`` below: the tests that
start multi-rank launches (torchrun, Megatron's or MindSpeed-LLM's own training) and the ones
that cost more than ~10 CPU seconds. The numbers are the CPU seconds (the test's process and its
children) measured on 2026-11-27 on the 2-core AMD EPYC host: on a quiet 2-core machine a test's
wall time is about its CPU time (a multi-rank launch's, about half of it). Add a test here when
it costs that much; docs/testing.md says what each tier costs."""

import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("poseidon", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("poseidon")

# Launches share one bytecode cache: the framework trees in FRAMEWORKS are read-only and the CI
# host sets PYTHONDONTWRITEBYTECODE, so every rank of every launch compiled MindSpeed-LLM's and
# Megatron's ~1,500 sources afresh (about 1.3 CPU-s a rank, measured 2026-12-04). The tests'
# subprocesses inherit this; the cache lives outside the repository.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("PYTHONPYCACHEPREFIX",
                      os.path.join(tempfile.gettempdir(), f"poseidon-pycache-{os.getuid()}"))

# "file::test" (every parametrization) -> CPU seconds measured (all of its parametrizations)
SLOW = {
    # core (no torch in the test process)
    "tests/test_fuzz_inputs.py::test_fuzz_cli_subprocess": 14,     # 30 CLI processes
    "tests/test_iteration_costs.py::test_search_with_optimizer_costs_is_exact": 72,
    "tests/test_iteration_costs.py::test_pruned_search_is_exact_under_the_dp_overlap": 68,
    "tests/test_callcost_profile.py::test_p2p_call_records_between_processes": 13,
    "tests/test_callcost_profile.py::test_a_pair_group_times_megatrons_own_calls": 30,
    "tests/test_search.py::test_safe_and_ridge_free_bound_match_exhaustive": 13,
    "tests/test_search_mixed.py::test_mixed_safe_exhaustive_and_brute_force_agree": 14,
    "tests/test_search_distributed.py::test_per_stage_tp_and_runner_up_and_two_jobs": 14,
    # integration: multi-rank launches (torchrun), Megatron's / MindSpeed-LLM's own scripts
    "tests/test_context_parallel.py::test_launch_keeps_the_scripts_context_parallelism_in_a_dry_run": 45,
    "tests/test_framework_rules.py::test_the_refused_plan_case_of_the_issue_launches_a_plan_megatron_accepts": 70,
    "tests/test_gpu_check.py::test_gpu_check_rehearsal_on_cpu": 67,
    "tests/test_launch_auto.py::test_one_line_patch_plans_and_trains": 25,
    "tests/test_launch_e2e.py::test_emulated_heterogeneous_training": 82,
    "tests/test_launch_e2e.py::test_dry_run_prints_flags_builds_nothing_and_second_launch_uses_the_cache": 95,
    "tests/test_launch_e2e.py::test_every_link_kind_gets_its_p2p_call_costs": 52,
    "tests/test_launch_e2e.py::test_corrupt_profile_cache_is_set_aside_and_reprofiled": 47,
    "tests/test_launch_e2e.py::test_a_rank_that_never_answers_is_named": 20,   # 2 phases
    "tests/test_launch_e2e.py::test_a_refusal_on_rank_0_exits_every_rank_with_2": 23,
    "tests/test_launch_e2e.py::test_ranks_the_plan_does_not_use_exit_0_and_megatron_sees_only_the_used_ones": 32,
    "tests/test_mindspeed_llm.py::test_the_real_release_is_imported": 24,
    "tests/test_mindspeed_llm_launch.py::test_dry_run_prints_the_plan_and_exits_0": 104,
    "tests/test_mindspeed_llm_launch.py::test_training_reaches_lm_loss": 115,
    "tests/test_mindspeed_llm_launch.py::test_expert_parallel_dry_run": 63,
    "tests/test_framework_state.py::test_profiling_a_moe_layer_leaves_no_framework_state": 19,
    # the three measured together (172 CPU-s, 2026-11-28, loaded host), split by wall time
    "tests/test_mindspeed_llm_launch.py::test_mixed_moe_training_with_first_k_dense": 58,
    "tests/test_mindspeed_llm_launch.py::test_a_moe_layer_freq_mindspeed_llm_ignores_is_one_line": 44,
    "tests/test_mindspeed_llm_launch.py::test_interleaved_training_on_megatron_core_0_12_1": 70,
    "tests/test_moe_ep_launch.py::test_poseidon_profile_writes_a_moe_record_per_ep": 12,
    "tests/test_profile_backend.py::test_two_ranks_switch_the_default_group_and_back_for_real": 15,
    "tests/test_profile_backend.py::test_a_rank_failing_on_the_device_group_is_named_by_the_others": 15,
    "tests/test_validate.py::test_real_validate_run_small": 11,
    "tests/test_moe_ep_launch.py::test_emulated_moe_training_with_expert_parallelism": 55,
    "tests/test_profile_torchrun.py::test_two_processes_measure_tp_2_and_the_plan_uses_it": 19,
    "tests/test_profile_torchrun.py::test_a_rank_that_never_answers_is_named": 24,   # 2 phases
    "tests/test_profile_torchrun.py::test_tp_above_the_processes_is_one_error_line": 3,
    "tests/test_profile_kinds.py::test_emulated_launch_profiles_both_kinds_and_the_dry_run_plans": 26,
    "tests/test_search_distributed.py::test_cli_distributed_under_torchrun_matches_one_process": None,   # not measured (a torchrun plan)
    "tests/test_search_distributed.py::test_a_rank_lost_under_torchrun_ends_with_an_error": 13,
    "tests/test_search_distributed.py::test_emulated_launch_on_two_hosts_shares_the_search": 18,
    # resume under a new plan (run by make test-mcore-versions; measured 2026-11-28, load ~30)
    "tests/test_resume_replan.py::test_save_records_the_plan_and_its_devices": 74,   # plan A
    "tests/test_resume_replan.py::test_resume_on_three_ranks_after_losing_one": 27,
    "tests/test_resume_replan.py::test_resume_with_the_types_speeds_swapped_at_tp_2": 42,
    "tests/test_resume_replan.py::test_moe_saved_at_ep_2_resumes_at_ep_1_on_three_ranks": 143,
    "tests/test_resume_replan.py::test_a_removed_shard_is_one_error_naming_it": 25,
    # issue 38 (measured 2026-11-28, same host): a real megatron-core MoE layer on the CPU; a
    # process that waits its 10 s for a peer that never comes
    "tests/test_bad_input.py::test_profile_of_moe_experts_with_bias_is_one_line": 12,
    "tests/test_bad_input.py::test_a_peer_that_never_starts_is_reported_within_the_budget": 3,
    # three processes importing torch and megatron-core 0.12.1's writer (2026-12-02, beside a
    # CI run: 37 CPU-s, 38 s wall)
    "tests/test_checkpoint_resume.py::test_megatron_core_0_12_1s_writer_gets_torchs_serialization_format": 37,
}


@pytest.hookimpl(tryfirst=True)   # before -m deselects: "not slow" must see these marks
def pytest_collection_modifyitems(config, items):
    modules = {}
    for item in items:
        base = item.nodeid.split("[", 1)[0]
        if getattr(item, "module", None) is not None:
            modules[base.split("::", 1)[0]] = item.module
        if base in SLOW:
            item.add_marker(pytest.mark.slow)
    # a renamed test must not drop out of the slow tier unnoticed (into the fast one)
    stale = [k for k in SLOW if k.split("::", 1)[0] in modules
             and not hasattr(modules[k.split("::", 1)[0]], k.split("::", 1)[1])]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW names no test: {stale}")

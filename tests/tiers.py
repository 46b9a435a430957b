"""The test tiers: each test belongs to exactly one of ``unit``, ``distributed``, ``flows`` and ``e2e``.

``tests/conftest.py`` marks every collected test with its tier, so ``pytest -m unit`` (``make test-fast``) runs the
fast tier alone. A test's tier is, first found:

1. an explicit marker on the test or its module (``@pytest.mark.distributed``, ``pytestmark = pytest.mark.e2e``);
2. its entry in :data:`TEST_TIERS` (``"file.py::test_name"``, for a test that differs from the rest of its file);
3. the tier of a fixture it uses (:data:`FIXTURE_TIERS`: a test on the Prefect test server is a ``flows`` test);
4. its file's entry in :data:`FILE_TIERS`.

A unit test takes about a second or less on an idle 2-core machine and starts no process, server or store; a
longer one, in a file of unit tests, gets its own line in :data:`TEST_TIERS` (measure with ``--durations``).

A test with no tier, or with two explicit tier markers, stops the session with a message naming it; so does a
``slow`` test in the ``unit`` tier. A new test file gets one line in :data:`FILE_TIERS`.
"""

from __future__ import annotations

TIERS = ("unit", "distributed", "flows", "e2e")  # what each holds: the markers in pyproject.toml

FIXTURE_TIERS = {"prefect_api": "flows", "slurm_cluster": "e2e", "slurm_tree_cluster": "e2e"}

FILE_TIERS = {
    "test_activation_checkpointing.py": "distributed",
    "test_anomaly.py": "distributed",
    "test_attention_paths.py": "unit",
    "test_attention_paths_distributed.py": "distributed",
    "test_audit_pins.py": "unit",
    "test_audit_pin_store.py": "flows",
    "test_audit_pins_by_job.py": "flows",
    "test_audit_trust.py": "flows",
    "test_bad_steps.py": "distributed",
    "test_bench_ratios.py": "unit",
    "test_bench_context_parallel.py": "distributed",
    "test_bench_smoke.py": "distributed",
    "test_bench_tables.py": "unit",
    "test_bf16_params.py": "distributed",
    "test_fp32_accumulation.py": "distributed",
    "test_blocks.py": "flows",
    "test_bounded_readers.py": "unit",
    "test_bounded_models.py": "unit",
    "test_check_sizes.py": "unit",
    "test_citations.py": "unit",
    "test_ckpt.py": "unit",
    "test_ckpt_async.py": "distributed",
    "test_ckpt_attacks.py": "distributed",
    "test_ckpt_tensor_table.py": "unit",
    "test_cli_config.py": "unit",
    "test_cluster.py": "e2e",
    "test_comm.py": "distributed",
    "test_comm_staging.py": "distributed",
    "test_comm_watchdog.py": "distributed",
    "test_compile.py": "distributed",
    "test_config.py": "unit",
    "test_config_doc.py": "unit",
    "test_context_sharding.py": "unit",
    "test_context_parallel_model.py": "distributed",
    "test_cp_activation_memory.py": "distributed",
    "test_data.py": "unit",
    "test_data_early_check.py": "unit",
    "test_data_cache.py": "unit",
    "test_data_prepare.py": "unit",
    "test_data_parallel.py": "distributed",
    "test_debug_dumps.py": "distributed",
    "test_debug_gradient.py": "distributed",
    "test_deployment.py": "flows",
    "test_determinism.py": "unit",
    "test_diverged_run.py": "e2e",
    "test_error_file.py": "unit",
    "test_fast_exit.py": "distributed",
    "test_kept_server.py": "flows",
    "test_doctor.py": "unit",
    "test_doctor_gpu.py": "unit",
    "test_document_packing.py": "distributed",
    "test_engine_3d.py": "distributed",
    "test_engine_cp.py": "distributed",
    "test_engine_hf.py": "distributed",
    "test_engine_reshard.py": "distributed",
    "test_eval_samples.py": "distributed",
    "test_eval_layouts.py": "distributed",
    "test_failure_lines.py": "e2e",
    "test_fixtures.py": "unit",
    "test_flow.py": "flows",
    "test_flow_log.py": "flows",
    "test_prefect_adapters.py": "flows",
    "test_global_config_job.py": "distributed",
    "test_global_config_rollback.py": "distributed",
    "test_gpu_check.py": "distributed",
    "test_host_staging.py": "distributed",
    "test_phase_peak.py": "unit",
    "test_plan_comms.py": "unit",
    "test_grad_sync_seam.py": "unit",
    "test_hal.py": "unit",
    "test_hf.py": "unit",
    "test_stream_model.py": "unit",
    "test_task_retries.py": "flows",
    "test_transient.py": "unit",
    "test_vlm.py": "unit",
    "test_llava_finetune.py": "distributed",
    "test_llava_prepare.py": "unit",
    "test_image_bounds.py": "unit",
    "test_image_data.py": "unit",
    "test_image_gate.py": "unit",
    "test_image_pool.py": "unit",
    "test_vlm_engine.py": "distributed",
    "test_vision_demo.py": "flows",
    "test_shakespeare_demo.py": "flows",
    "test_shape_set.py": "unit",
    "test_hierarchical_allreduce.py": "distributed",
    "test_hostile_input.py": "unit",
    "test_import_rules.py": "unit",
    "test_interrupt.py": "e2e",
    "test_interrupt_parts.py": "unit",
    "test_job_lifetime.py": "distributed",
    "test_job_paths.py": "flows",
    "test_launch.py": "distributed",
    "test_launch_gate.py": "e2e",
    "test_launcher.py": "distributed",
    "test_store_binding.py": "distributed",
    "test_lazy_dynamo.py": "distributed",
    "test_lineage.py": "unit",
    "test_lineage_lease.py": "unit",
    "test_mlflow_sink.py": "flows",
    "test_lora.py": "distributed",
    "test_memory_model.py": "distributed",
    "test_memory_records.py": "distributed",
    "test_mesh.py": "distributed",
    "test_axes_generic.py": "unit",
    "test_mesh_axes.py": "unit",
    "test_moe.py": "unit",
    "test_moe_config.py": "unit",
    "test_moe_training.py": "distributed",
    "test_expert_parallel.py": "distributed",
    "test_expert_parallel_training.py": "distributed",
    "test_all_to_all.py": "distributed",
    "test_mixed_precision.py": "distributed",
    "test_mlflow_view_browser.py": "flows",
    "test_model.py": "unit",
    "test_model_export.py": "distributed",
    "test_mp_helper.py": "distributed",
    "test_nccl_rules.py": "distributed",
    "test_nccl_rules_job.py": "distributed",
    "test_one_voice.py": "unit",
    "test_orchestrator_shape.py": "unit",
    "test_perf_model.py": "unit",
    "test_precision_policy.py": "unit",
    "test_perm_audit.py": "unit",
    "test_perm_entrypoints.py": "unit",
    "test_perm_guard.py": "unit",
    "test_perm_mp.py": "distributed",
    "test_perm_tokens.py": "unit",
    "test_pipeline.py": "distributed",
    "test_param_placement.py": "unit",
    "test_pipeline_schedules.py": "unit",
    "test_placement.py": "unit",
    "test_plan.py": "unit",
    "test_plan_accuracy.py": "distributed",
    "test_plan_long_context.py": "unit",
    "test_plan_memory.py": "unit",
    "test_prefect_api_lost.py": "e2e",
    "test_prefect_server_guard.py": "distributed",
    "test_prometheus_metrics.py": "distributed",
    "test_prometheus_scrape.py": "e2e",
    "test_quiet_output.py": "unit",
    "test_rank_placement.py": "unit",
    "test_readme.py": "e2e",
    "test_recovery.py": "flows",
    "test_registry_aliases.py": "flows",
    "test_reshard.py": "unit",
    "test_resume.py": "distributed",
    "test_revocation.py": "distributed",
    "test_ring_attention.py": "distributed",
    "test_run_settings.py": "unit",
    "test_runs_compare.py": "flows",
    "test_s3.py": "unit",
    "test_sample_context.py": "unit",
    "test_eval_cost.py": "unit",
    "test_loop_shape.py": "unit",
    "test_fault_repeat.py": "unit",
    "test_second_run.py": "flows",
    "test_tracking_store.py": "distributed",
    "test_tracking_store_job.py": "e2e",
    "test_sft_data.py": "unit",
    "test_slurm_lab.py": "e2e",
    "test_slurm.py": "e2e",
    "test_slurm_requeue.py": "e2e",
    "test_slurm_cancel.py": "e2e",
    "test_sequence_parallel.py": "distributed",
    "test_sequence_parallel_engine.py": "distributed",
    "test_slurm_doctor.py": "e2e",
    "test_slurm_facts.py": "unit",
    "test_slurm_script.py": "unit",
    "test_slurm_secrets.py": "unit",
    "test_slurm_topology.py": "e2e",
    "test_slurm_placement.py": "e2e",
    "test_slurm_placement_file.py": "unit",
    "test_startup.py": "e2e",
    "test_step_devices.py": "unit",
    "test_step_loss.py": "distributed",
    "test_tensor_parallel.py": "distributed",
    "test_tiers.py": "unit",
    "test_topology.py": "unit",
    "test_validate_data.py": "unit",
    "test_vocab_padding.py": "distributed",
    "test_weight_decay.py": "distributed",
    "test_worker_sigterm.py": "flows",
    "test_zero.py": "distributed",
    "test_zero3_memory.py": "distributed",
    "test_zero3_lora.py": "distributed",
    "test_zero3_pp.py": "distributed",
}

TEST_TIERS = {
    "test_shakespeare_demo.py::test_token_sizes_count_the_bytes_and_characters_of_the_text": "unit",
    "test_shakespeare_demo.py::test_a_tokenizer_whose_tokens_are_not_bytes_gives_no_per_byte_figure": "unit",
    "test_attention_paths.py::test_packed_attention_memory_grows_linearly_not_with_s_squared": "distributed",
    "test_readme.py::test_readme_blocks_are_found_and_named": "unit",
    "test_readme.py::test_sections_run_elsewhere_are_in_the_readme_and_still_run_there": "unit",
    "test_readme.py::test_the_readme_is_one_screen_and_links_the_rest": "unit",
    "test_activation_checkpointing.py::test_negative_control_a_recomputation_without_the_rng_state_changes_the_gradients": "unit",
    "test_moe.py::test_activation_checkpointing_gives_the_same_gradients_and_counts_each_load_once": "distributed",  # 3 s
    "test_activation_checkpointing.py::test_no_recomputation_without_autograd": "unit",
    "test_anomaly.py::test_a_scrape_is_a_monitor_read_under_its_roles_rules": "unit",
    "test_anomaly.py::test_each_kind_fires_on_its_cause_and_a_normal_run_is_quiet": "unit",
    "test_anomaly.py::test_thresholds_are_warmed_up_and_relative_to_the_run": "unit",
    "test_bench_tables.py::test_make_bench_smoke_runs_a_script_and_renders_it_into_a_scratch_copy": "distributed",
    "test_bounded_readers.py::test_a_1_gib_single_line_text_file_is_refused_fast_with_bounded_memory": "distributed",
    "test_ckpt.py::test_crash_during_save_keeps_previous": "distributed",
    "test_ckpt.py::test_two_process_save_verifies": "distributed",
    "test_ckpt_attacks.py::test_a_malformed_manifest_makes_its_step_not_intact_and_the_previous_one_is_used": "unit",
    "test_ckpt_attacks.py::test_a_symbolic_link_in_a_step_is_refused_not_followed": "unit",
    "test_cli_config.py::test_real_kc_entry_point_starts_nothing": "distributed",
    "test_data_cache.py::test_ranks_racing_to_build_share_one_entry": "distributed",
    "test_data_prepare.py::test_the_written_config_trains_a_few_steps_through_the_engine": "distributed",
    "test_doctor.py::test_all_checks_pass_on_a_good_local_setup": "distributed",
    "test_doctor.py::test_cli_json_and_table_and_exit_codes": "distributed",
    "test_doctor.py::test_flow_doctor_reuses_a_recent_gloo_pass_and_kc_doctor_does_not": "distributed",
    "test_doctor.py::test_nodes_reachability_and_version_agreement": "distributed",
    "test_doctor.py::test_gpu_versions_of_every_node_are_compared_over_the_agents": "distributed",
    "test_doctor_gpu.py::test_the_smoke_worker_runs_for_real_over_gloo_on_two_processes": "distributed",
    "test_document_packing.py::test_packed_loss_equals_the_documents_run_one_by_one": "unit",
    "test_document_packing.py::test_window_fields_restart_per_document": "unit",
    "test_engine_3d.py::test_worker_refuses_bad_plan_before_building_anything": "unit",
    "test_vlm_engine.py::test_plan_refuses_a_vision_tower_only_with_sequence_or_context_parallelism": "unit",
    "test_vlm_engine.py::test_plan_shows_the_encoder_layout_and_memory": "unit",
    "test_vlm_engine.py::test_encoder_tensor_parallel_refusals_name_the_field": "unit",
    "test_llava_finetune.py::test_vision_fields_come_from_the_directory_and_a_mismatch_names_the_field": "unit",
    "test_sequence_parallel_engine.py::test_bad_sequence_parallel_settings_name_the_field": "unit",
    "test_eval_samples.py::test_greedy_decode_stops_each_prompt_at_its_end_token_or_the_limit": "unit",
    "test_eval_samples.py::test_sft_eval_cases_are_the_prompt_and_the_completion_with_its_end_token": "unit",
    "test_failure_lines.py::test_kc_train_of_a_failing_worker_says_the_cause_once_and_keeps_torchs_output_in_the_run_dir": "e2e",
    "test_flow_log.py::test_task_run_formatter_and_progress_log": "unit",
    "test_global_config_job.py::test_config_set_rejects_bad_values_and_refuses_an_operator_the_job_does_not_trust": "unit",
    "test_gpu_check.py::test_flops_per_token_is_the_performance_notes_worked_example": "unit",
    "test_gpu_check.py::test_a_failing_or_overrunning_section_is_recorded_and_the_next_one_still_runs": "unit",
    "test_job_lifetime.py::test_split_tokens_gives_a_rank_only_its_own_modules": "unit",
    "test_lora.py::test_zero3_with_lora_is_not_said_to_run_as_zero2": "unit",
    "test_mixed_precision.py::test_an_overflow_skips_halves_the_scale_and_clean_steps_grow_it": "unit",
    "test_mixed_precision.py::test_fp32_and_bf16_never_scale_nor_sync": "unit",
    "test_mixed_precision.py::test_hysteresis_backs_off_only_after_that_many_overflows": "unit",
    "test_model_export.py::test_a_registered_model_resolves_to_its_files_and_adapters_are_refused": "flows",
    "test_model_export.py::test_kc_train_hands_a_registered_base_to_the_flow": "e2e",
    "test_model_export.py::test_register_model_moves_newest_always_and_champion_only_to_a_higher_accuracy": "flows",
    "test_model_export.py::test_register_without_log_model_is_said_unused": "unit",
    "test_perm_audit.py::test_g1_two_processes_1000_records": "distributed",
    "test_perm_entrypoints.py::test_monitor_cannot_read_another_tasks_run_by_id": "flows",
    "test_perm_entrypoints.py::test_monitor_reads_metrics": "flows",
    "test_data_early_check.py::test_kc_train_with_a_wrong_data_path_fails_in_seconds_with_one_line_and_starts_nothing": "e2e",
    "test_interrupt_parts.py::test_a_ctrl_c_during_the_topology_probe_prints_no_traceback_of_its_processes": "distributed",
    "test_prefect_api_lost.py::test_a_lost_api_interrupts_the_interruptible_stretch_only": "unit",
    "test_precision_policy.py::test_one_optimizer_class_per_stage_and_the_policy_decides_the_masters": "distributed",
    "test_prefect_api_lost.py::test_before_registration_refuses_once_the_api_is_lost": "unit",
    "test_registry_aliases.py::test_the_identity_of_held_out_files_is_their_bytes": "unit",
    "test_slurm_script.py::test_the_time_limit_trap_marks_the_stop_file_and_waits_for_the_step": "distributed",
    "test_slurm_script.py::test_every_rank_learns_of_the_stop_file_at_the_same_log_boundary_after_a_step": "distributed",
    "test_tensor_parallel.py::test_bad_tp_plan_is_refused_with_numbers": "unit",
    "test_tensor_parallel.py::test_replication_needs_tp_multiple_of_kv_heads": "unit",
    "test_tensor_parallel.py::test_shard_slices_cover_every_full_tensor": "unit",
    "test_topology.py::test_probe_measures_every_pair_with_real_gloo": "distributed",
    "test_vocab_padding.py::test_a_sample_that_cannot_be_rendered_is_said_and_scored_on_ids": "unit",
    "test_vocab_padding.py::test_byte_tokenizer_shows_ids_outside_its_vocabulary": "unit",
    "test_vocab_padding.py::test_hf_tokenizer_shows_ids_outside_its_vocabulary": "unit",
    "test_vocab_padding.py::test_vocab_padding_note_names_both_sizes_only_when_the_model_is_larger": "unit",
    "test_weight_decay.py::test_norms_and_embedding_are_the_excluded_kinds": "unit",
}


class TierError(ValueError):
    """A test has no tier or more than one."""


#: files that start first when ``make test TEST_WORKERS=2`` runs them on two workers (``--dist loadfile``): the longest,
#: so that no long file starts last while the other worker has nothing left (then every e2e, flows, distributed and
#: unit file, in that order: long files first, the many short ones fill the gaps)
RUN_FIRST = (
    "test_readme.py",
    "test_cluster.py",
    "test_slurm.py",
    "test_slurm_requeue.py",
    "test_slurm_cancel.py",
    "test_slurm_placement.py",
    "test_recovery.py",
    "test_gpu_check.py",
    "test_bench_smoke.py",
    "test_deployment.py",
)


def run_order(file: str) -> tuple[int, int]:
    """The sort key of a test file in the session: :data:`RUN_FIRST` in its order, then the files by tier."""
    if file in RUN_FIRST:
        return (0, RUN_FIRST.index(file))
    return (1, TIERS[::-1].index(FILE_TIERS.get(file, "unit")))


def tier_of(file: str, test: str, explicit: list[str], fixtures: list[str]) -> str:
    """The tier of test ``test`` (its name without parameters) of ``file`` (a file name in ``tests/``), given the
    tier markers set on it (``explicit``) and the names of the fixtures it uses."""
    marked = sorted(set(explicit))
    if len(marked) > 1:
        raise TierError(f"{file}::{test} is marked with {len(marked)} tiers ({', '.join(marked)}): keep one")
    if marked:
        return marked[0]
    tier = TEST_TIERS.get(f"{file}::{test}")
    if tier is None:
        tier = next((FIXTURE_TIERS[f] for f in fixtures if f in FIXTURE_TIERS), None)
    if tier is None:
        tier = FILE_TIERS.get(file)
    if tier is None:
        raise TierError(f"{file}::{test} has no tier: add {file!r} to FILE_TIERS in tests/tiers.py")
    if tier not in TIERS:
        raise TierError(f"{file}::{test} has tier {tier!r}, not one of {', '.join(TIERS)}")
    return tier

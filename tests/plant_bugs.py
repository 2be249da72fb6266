"""Plant each plausible bug in a copy of the course and run the tests that must catch it.

    python tests/plant_bugs.py              # every bug below (takes a while: one pytest run each)
    python tests/plant_bugs.py set_epoch    # only the bugs whose name contains "set_epoch"

A test that passes whatever the code does proves nothing. For each central claim of the course,
BUGS names a one-line change a real author could make (drop `set_epoch`, forget to divide by the
accumulation steps, skip the optimizer state on resume ...) and the tests that must fail with it.
Each bug is planted in a fresh copy of the repository (what git tracks or would track; the venv
is shared), and its tests run there. Prints CAUGHT or MISSED per bug; exits 1 if any was missed,
or if a planted line is no longer in its file (the bug list must follow the code).
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, file, the line as it is, the line with the bug, the tests that must fail)
BUGS = [
    (
        "lesson 0: every process takes rank 0's shard",
        "ddp_minimal.py",
        "num_replicas=world_size, rank=rank, seed=args.seed",
        "num_replicas=world_size, rank=0, seed=args.seed",
        [
            "tests/test_minimal.py::test_two_processes_equal_one_process_on_the_global_batch_and_learn"
        ],
    ),
    (
        "lesson 1: no set_epoch",
        "ddp_mnist.py",
        "self.sampler.set_epoch(epoch)",
        "pass",
        [
            "tests/test_mnist.py::test_two_ranks_train_the_model_one_process_trains_on_the_global_batch"
        ],
    ),
    (
        "lesson 1: evaluation not summed over the ranks",
        "ddp_mnist.py",
        "dist.all_reduce(totals)",
        "pass",
        ["tests/test_mnist.py::test_every_test_sample_is_counted_once_and_the_output_is_rank_0s"],
    ),
    (
        "lesson 1: every rank scores the whole test set",
        "ddp_mnist.py",
        "range(self.ddp.rank, len(self.test_set), self.ddp.world_size)",
        "range(len(self.test_set))",
        ["tests/test_mnist.py::test_every_test_sample_is_counted_once_and_the_output_is_rank_0s"],
    ),
    (
        "helper: each CPU rank takes every core (oversubscribed)",
        "ddp_common.py",
        "torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))",
        "torch.set_num_threads(os.cpu_count() or 1)",
        ["tests/test_common.py::test_setup_under_mp_spawn"],
    ),
    (
        "helper: OMP_NUM_THREADS overridden",
        "ddp_common.py",
        'elif "OMP_NUM_THREADS" not in env:',
        "else:",
        ["tests/test_common.py::test_setup_under_torchrun"],
    ),
    (
        "helper: no namespace per restart attempt",
        "ddp_common.py",
        "store = dist.PrefixStore(f\"attempt{env['TORCHELASTIC_RESTART_COUNT']}\", agent)",
        "store = agent",
        ["tests/test_common.py::test_torchrun_shared_store_gets_one_namespace_per_attempt"],
    ),
    (
        "helper: mp.spawn's workers under srun bound to its one GPU",
        "ddp_common.py",
        "bound = gpus == 1 and srun and",
        'bound = gpus == 1 and "SLURM_PROCID" in os.environ and',
        [
            "tests/test_common.py::"
            "test_one_gpu_bound_per_srun_task_is_cuda_0_but_two_torchrun_ranks_never_share_it"
        ],
    ),
    (
        "lesson 2: the loss not scaled by W/G",
        "ddp_training.py",
        "self.scaler.scale(loss * self.ddp.world_size / self.global_batch)",
        "self.scaler.scale(loss / self.global_batch)",
        ["tests/test_training.py::test_one_global_batch_is_the_same_run_on_any_world_size"],
    ),
    (
        "lesson 2: a log line shows the next step's learning rate",
        "ddp_training.py",
        '| lr {self.lr:.4g}"',
        '| lr {self._learning_rate():.4g}"',
        [
            "tests/test_training.py::test_the_learning_rate_is_scaled_to_the_global_batch_and_warmed_up"
        ],
    ),
    (
        "lesson 2: no set_epoch",
        "ddp_training.py",
        "self.sampler.set_epoch(epoch)",
        "pass",
        ["tests/test_training.py::test_every_epoch_trains_a_new_shuffle"],
    ),
    (
        "lesson 2: every micro-batch all-reduces",
        "ddp_training.py",
        "with contextlib.nullcontext() if last else self.model.no_sync():",
        "with contextlib.nullcontext():",
        ["tests/test_training.py::test_only_the_last_micro_batch_of_a_step_all_reduces"],
    ),
    (
        "lesson 2: an empty scaler state loaded under fp16",
        "ddp_training.py",
        'if ckpt["scaler"]:',
        "if True:",
        ["tests/test_training.py::test_mixed_precision_on_cpu_learns"],
    ),
    (
        "lesson 2: each rank's random state not restored",
        "ddp_training.py",
        'torch.set_rng_state(rng["cpu"])',
        "pass",
        ["tests/test_training.py::test_a_resume_on_the_same_world_size_continues_bitwise"],
    ),
    (
        "lesson 2: every rank draws one random stream",
        "ddp_training.py",
        "torch.manual_seed(self.args.seed + 1000 * self.step + self.ddp.rank)",
        "torch.manual_seed(self.args.seed + 1000 * self.step)",
        ["tests/test_training.py::test_a_resume_on_the_same_world_size_continues_bitwise"],
    ),
    (
        "lessons 2 and 7 share a checkpoint folder",
        "ddp_knobs.py",
        'default="./checkpoints/lesson7"',
        'default="./checkpoints/lesson2"',
        ["tests/test_style.py::test_each_lesson_that_resumes_has_a_checkpoint_folder_of_its_own"],
    ),
    (
        "lesson 5: mp.spawn's workers meet at a MASTER_ADDR the shell exported",
        "gpt2_ddp.py",
        'os.environ["MASTER_ADDR"] = "127.0.0.1"',
        'os.environ.setdefault("MASTER_ADDR", "127.0.0.1")',
        ["tests/test_gpt2.py::test_a_failing_worker_is_one_line_and_the_parent_alone_fetched"],
    ),
    (
        "lesson 5: the head's weight gradient summed in fp16 under fp16 autocast (overflows)",
        "gpt2_model.py",
        "                if fp16:  # over a chunk's rows",
        "                if False:  # over a chunk's rows",
        ["tests/test_compare.py::test_chunked_loss_under_fp16_autocast_does_not_overflow"],
    ),
    (
        "lesson 5: a file --init-from cannot read is a traceback",
        "gpt2_model.py",
        "    except Exception as e:  # an old pytorch_model.bin",
        "    except KeyboardInterrupt as e:  # an old pytorch_model.bin",
        ["tests/test_gpt2.py::test_user_mistakes_are_one_line_exit_2"],
    ),
    (
        "lesson 7: a checkpoint of another world size resumed",
        "ddp_knobs.py",
        "if saved != (self.ddp.world_size, self.args.batch_size * self.ddp.world_size):",
        "if False:",
        ["tests/test_knobs.py::test_a_resume_on_another_world_size_is_refused_in_one_line"],
    ),
    (
        "lesson 2: CIFAR read with plain pickle",
        "training_data.py",
        'entry = ArraysOnly(f, encoding="latin1").load()',
        'entry = pickle.load(f, encoding="latin1")',
        ["tests/test_training.py::test_a_cifar_file_that_would_run_code_is_refused"],
    ),
    (
        "lesson 2: a handed-over checkpoint without a best-k list (KeyError traceback)",
        "ddp_training.py",
        "except (KeyError, TypeError, ValueError):",
        "except (TypeError, ValueError):",
        ["tests/test_training.py::test_a_crafted_checkpoint_cannot_delete_files_outside_its_dir"],
    ),
    (
        "lesson 3: a snapshot resumed on other data (another --samples)",
        "multi_gpu_torchrun.py",
        'if checkpoint.get("data", self.data_name) != self.data_name:',
        "if False:",
        ["tests/test_elastic.py::test_a_global_batch_that_cannot_be_used_is_one_error_line"],
    ),
    (
        "lesson 3: the optimizer state skipped on resume",
        "multi_gpu_torchrun.py",
        "checkpoint = load_checkpoint(self.path, model=model, optimizer=self.optimizer)",
        "checkpoint = load_checkpoint(self.path, model=model)",
        [
            "tests/test_elastic.py::test_the_same_command_resumes_on_4_3_and_1_ranks_at_the_next_sample"
        ],
    ),
    (
        "lesson 3: every rank draws one random stream",
        "multi_gpu_torchrun.py",
        "torch.manual_seed(1000 * self.step + ddp.rank)",
        "torch.manual_seed(1000 * self.step)",
        ["tests/test_torchrun_restart.py::test_uninterrupted_run_learns_and_saves_the_schema"],
    ),
    (
        "lesson 3: a preempted run exits 0",
        "multi_gpu_torchrun.py",
        "sys.exit(128 + stop_signal)",
        "sys.exit(0)",
        [
            "tests/test_torchrun_restart.py::test_without_restarts_a_crash_fails_preemptions_save_and_relaunches_resume"
        ],
    ),
    (
        "lesson 3: a rank's share cut as if W divided G",
        "multi_gpu_torchrun.py",
        "begin = -(-(step * global_batch - rank) // world_size)",
        "begin = step * global_batch // world_size",
        ["tests/test_elastic.py::test_same_global_batch_is_the_same_run_on_1_2_and_3_ranks"],
    ),
    (
        "lesson 3: ranks do not agree on the snapshot",
        "multi_gpu_torchrun.py",
        "if len(set(found)) > 1:",
        "if False:",
        [
            "tests/test_torchrun_restart.py::test_ranks_that_disagree_on_the_snapshot_stop_in_one_line"
        ],
    ),
    (
        "lesson 4: the local rank picks the shard",
        "multinode.py",
        "DistributedSampler(train_set, ddp.world_size, ddp.rank, seed=args.seed)",
        "DistributedSampler(train_set, ddp.world_size, ddp.local_rank, seed=args.seed)",
        ["tests/test_multinode.py::test_two_nodes_restart_after_a_worker_is_killed"],
    ),
    (
        "lesson 4: only global rank 0 writes the checkpoint",
        "multinode.py",
        "save_checkpoint(state, path, writer=self.ddp.local_rank == 0)",
        "save_checkpoint(state, path, writer=self.ddp.rank == 0)",
        [
            "tests/test_multinode.py::test_two_nodes_stage_their_own_data_and_save_their_own_checkpoint"
        ],
    ),
    (
        "lesson 4: only node 0 stages the data",
        "multinode.py",
        "if ddp.local_rank == 0:\n        write_data(args, path)",
        "if False:\n        write_data(args, path)",
        [
            "tests/test_multinode.py::test_two_nodes_stage_their_own_data_and_save_their_own_checkpoint"
        ],
    ),
    (
        "lesson 2: fused SGD's momentum starts as unwritten memory (fp16's skipped first step)",
        "ddp_training.py",
        'self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)',
        "pass",
        [
            "tests/test_training.py::test_fp16_steps_the_scaler_skips_first_leave_the_weights_as_they_were"
        ],
    ),
    (
        "lesson 2: a resume with another --seed passes (every later epoch shuffled otherwise)",
        "training_data.py",
        'name = f"{name} ({len(x)} images, seed {args.seed})"',
        'name = f"{name} ({len(x)} images)"',
        ["tests/test_training.py::test_data_a_run_cannot_use_is_refused_before_training"],
    ),
    (
        "lesson 4: a node's different copy of the data passes",
        "multinode.py",
        'if len(digests) > 1 or "none" in digests:',
        'if "none" in digests:',
        [
            "tests/test_multinode.py::test_a_node_without_the_data_or_with_another_copy_stops_the_job_in_one_line"
        ],
    ),
    (
        "lesson 4: nodes agree on the step only (two runs' files of one step pass)",
        "multinode.py",
        'mine = (step, digest(ckpt["model"].values()))',
        'mine = (step, "unchecked")',
        [
            "tests/test_multinode.py::test_a_static_job_on_another_world_size_resumes_from_each_nodes_own_checkpoint"
        ],
    ),
    (
        "lesson 4: a resume on other data than the checkpoint's",
        "multinode.py",
        'if ckpt.get("data", self.data_name) != self.data_name:',
        "if False:",
        [
            "tests/test_multinode.py::test_a_static_job_on_another_world_size_resumes_from_each_nodes_own_checkpoint"
        ],
    ),
    (
        "lesson 4: data files read as they are (float64 features from numpy)",
        "multinode.py",
        'x_train, x_test = sets["x_train"].float(), sets["x_test"].float()',
        'x_train, x_test = sets["x_train"], sets["x_test"]',
        [
            "tests/test_multinode.py::test_a_static_job_on_another_world_size_resumes_from_each_nodes_own_checkpoint"
        ],
    ),
    (
        "lesson 4: a copy cut short (a full disk) left on the node's disk",
        "multinode.py",
        "os.remove(partial)",
        "pass",
        [
            "tests/test_multinode.py::test_a_node_without_the_data_or_with_another_copy_stops_the_job_in_one_line"
        ],
    ),
    (
        "lesson 2: a resume on other data than the checkpoint's (--data auto's fallback)",
        "ddp_training.py",
        'if checkpoint.get("data", self.data_name) != self.data_name:',
        "if False:",
        ["tests/test_training.py::test_data_a_run_cannot_use_is_refused_before_training"],
    ),
    (
        "lesson 2: CIFAR-10 labels not checked (cross_entropy fails mid-run)",
        "training_data.py",
        'if not set(entry["labels"]) <= set(range(10)):',
        "if False:",
        ["tests/test_training.py::test_data_a_run_cannot_use_is_refused_before_training"],
    ),
    (
        "lesson 2: a subset too small to validate on (a division by zero after an epoch)",
        "training_data.py",
        "if len(x) < 10:",
        "if False:",
        ["tests/test_training.py::test_data_a_run_cannot_use_is_refused_before_training"],
    ),
    (
        "lesson 8: every rank prints the usage mistake",
        "ddp_debug.py",
        'fail(f"--fix {args.fix} does not fix --fault {args.fault}: fixes: {FIXES}", 2, True)',
        'fail(f"--fix {args.fix} does not fix --fault {args.fault}: fixes: {FIXES}")',
        ["tests/test_debug.py::test_a_usage_mistake_is_one_error_line_from_rank_0"],
    ),
    (
        "lesson 8: --timeout nan let through",
        "ddp_debug.py",
        'if not 0 < args.timeout < float("inf"):',
        "if args.timeout <= 0:",
        ["tests/test_debug.py::test_a_usage_mistake_is_one_error_line_from_rank_0"],
    ),
    (
        "lesson 4: AdamW fused on GPUs only (a CPU checkpoint resumes unfused there)",
        "multinode.py",
        "lr=args.lr, fused=True)",
        "lr=args.lr, fused=self.on_gpu)",
        ["tests/test_multinode.py::test_stopped_inside_an_epoch_resumes_where_it_stopped"],
    ),
    (
        "lesson 4: launch_ddp.sh's one-node workers meet at the machine's name",
        "launch_ddp.sh",
        'run "${TORCHRUN[@]}" --local-addr=127.0.0.1 --standalone',
        'run "${TORCHRUN[@]}" --standalone',
        ["tests/test_multinode.py::test_launch_ddp_runs_where_the_machine_name_does_not_resolve"],
    ),
    (
        "lesson 4: launch_ddp.sh's c10d workers on one machine meet at its name",
        "launch_ddp.sh",
        "LOCAL=(--local-addr=127.0.0.1)",
        "LOCAL=()",
        ["tests/test_multinode.py::test_launch_ddp_runs_where_the_machine_name_does_not_resolve"],
    ),
    (
        "lesson 5: DDP without gradient_as_bucket_view (a second copy of every gradient)",
        "gpt2_ddp.py",
        "self.model = DDP(model, gradient_as_bucket_view=True) if ddp.world_size > 1 else model",
        "self.model = DDP(model) if ddp.world_size > 1 else model",
        [
            "tests/test_gpt2.py::test_torchrun_fetches_before_joining_keeps_gradients_in_buckets_and_compiles_ddp"
        ],
    ),
    (
        "lesson 4: the Slurm script takes the first node with head -n 1 (SIGPIPE on long lists)",
        "slurm/train.sbatch",
        '"$SLURM_JOB_NODELIST" | sed -n 1p)',
        '"$SLURM_JOB_NODELIST" | head -n 1)',
        ["tests/test_slurm.py::test_first_node_of_the_node_list_comes_from_scontrol"],
    ),
    (
        "lesson 5: no set_epoch",
        "gpt2_ddp.py",
        "self.sampler.set_epoch(epoch)",
        "pass",
        [
            "tests/test_gpt2.py::test_two_ranks_fine_tune_as_one_process_with_exact_val_loss_and_export_back"
        ],
    ),
    (
        "lesson 5: the loss not scaled by the share",
        "gpt2_ddp.py",
        "loss = self.forward(x, y) * (len(x) * self.ddp.world_size / self.global_batch)",
        "loss = self.forward(x, y)",
        ["tests/test_gpt2.py::test_a_resume_on_another_world_size_ends_as_the_uninterrupted_run"],
    ),
    (
        "lesson 5: the optimizer state skipped on resume",
        "gpt2_ddp.py",
        "ckpt = load_checkpoint(path, model=model, optimizer=self.optimizer) if path else {}",
        "ckpt = load_checkpoint(path, model=model) if path else {}",
        ["tests/test_gpt2.py::test_resume_continues_bitwise_like_an_uninterrupted_run"],
    ),
    (
        "lesson 5: an empty scaler state loaded under fp16",
        "gpt2_ddp.py",
        'if ckpt["scaler"]:',
        "if True:",
        ["tests/test_gpt2.py::test_one_process_resumes_a_checkpoint_saved_without_fp16_under_fp16"],
    ),
    (
        "lesson 6: efficiency not divided by N",
        "benchmark_extras.py",
        "return tput_n / (n * tput_1)",
        "return tput_n / tput_1",
        ["tests/test_benchmark.py::test_formulas_against_hand_values"],
    ),
    (
        "lesson 6: busbw without the factor 2",
        "benchmark_extras.py",
        "return alg_bw * 2 * (n - 1) / n",
        "return alg_bw * (n - 1) / n",
        ["tests/test_benchmark.py::test_formulas_against_hand_values"],
    ),
    (
        "lesson 7: ZeRO saves without consolidating",
        "ddp_knobs.py",
        "self.optimizer.consolidate_state_dict(to=0)",
        "pass",
        [
            "tests/test_knobs.py::test_zero_matches_the_unsharded_optimizer_with_half_its_state_per_process"
        ],
    ),
    (
        "lesson 7: PowerSGD's error feedback not restored",
        "knobs_extras.py",
        "for key in POWERSGD_TENSORS:\n        setattr(",
        "for key in ():\n        setattr(",
        ["tests/test_knobs.py::test_resume_with_zero_and_powersgd_continues_bitwise"],
    ),
    (
        "lesson 7: PowerSGD's state restored before DDP regroups its buckets",
        "knobs_extras.py",
        "model(sample).sum().backward()",
        "pass",
        ["tests/test_knobs.py::test_resume_with_zero_and_powersgd_continues_bitwise"],
    ),
    (
        "lesson 7: a resume with another --batch-size goes through (its steps are other samples)",
        "ddp_knobs.py",
        "if saved != (self.ddp.world_size, self.args.batch_size * self.ddp.world_size):",
        "if saved[0] != self.ddp.world_size:",
        [
            "tests/test_knobs.py::test_a_resume_with_another_batch_size_is_refused_and_one_past_max_steps_trains_nothing"
        ],
    ),
    (
        "lesson 7: a run resumed past --max-steps trains on (== where >= belongs)",
        "ddp_knobs.py",
        "            if self.step >= self.last_step:\n                break\n            loss_sum",
        "            if self.step == self.last_step:\n                break\n            loss_sum",
        [
            "tests/test_knobs.py::test_a_resume_with_another_batch_size_is_refused_and_one_past_max_steps_trains_nothing"
        ],
    ),
    (
        "lesson 8: the uneven fix without Join",
        "ddp_debug.py",
        "join = Join([model])",
        "join = nullcontext()",
        ["tests/test_debug.py::test_fixes_run_and_join_shadows_the_ranks_that_ran_out_with_zeros"],
    ),
    (
        "lesson 8: monitored_barrier on the default group",
        "ddp_debug.py",
        "dist.monitored_barrier(monitor,",
        "dist.monitored_barrier(None,",
        [
            "tests/test_debug.py::test_monitored_barrier_needs_the_gloo_group_the_lesson_makes_beside_nccl"
        ],
    ),
    (
        "lesson 8: a straggler on one rank is not refused (it sleeps 100 x --timeout)",
        "ddp_debug.py",
        'args.fault in ("mismatch", "uneven", "straggler")',
        'args.fault in ("mismatch", "uneven")',
        ["tests/test_debug.py::test_a_fault_that_needs_two_ranks_is_refused_on_one"],
    ),
    (
        "lesson 9: the run compared with itself, not with --reference",
        "ddp_from_scratch.py",
        "zip(model.state_dict().values(), reference.state_dict().values(), strict=True)",
        "zip(model.state_dict().values(), model.state_dict().values(), strict=True)",
        ["tests/test_from_scratch.py::test_the_printed_difference_is_from_the_reference_file"],
    ),
    (
        "lesson 9: the naive sync does not divide",
        "ddp_from_scratch.py",
        "            p.grad /= self.world_size",
        "            pass",
        [
            "tests/test_from_scratch.py::test_every_hand_written_sync_trains_the_weights_torch_ddp_trains"
        ],
    ),
    (
        "lesson 9: a bucket sent before its last gradient",
        "ddp_from_scratch.py",
        "self.missing[len(self.sent)] == 0:",
        "self.missing[len(self.sent)] <= 1:",
        [
            "tests/test_from_scratch.py::test_every_hand_written_sync_trains_the_weights_torch_ddp_trains"
        ],
    ),
]


def repo_copy(dest):
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    # A git repository of its own: the tests copy "what git tracks" (conftest.repo_copy).
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)


def plant(name, file, original, planted, tests):
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        copy = Path(tmp)
        repo_copy(copy)
        source = (copy / file).read_text()
        if source.count(original) != 1:
            return f"STALE  {name}: {original!r} is in {file} {source.count(original)} times"
        (copy / file).write_text(source.replace(original, planted))
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-n",
                "0",
                "-p",
                "no:cacheprovider",
                *tests,
            ],
            cwd=copy,
            capture_output=True,
            text=True,
        )
        if result.returncode == 1:
            return f"CAUGHT {name}"
        verdict = "MISSED" if result.returncode == 0 else f"ERROR (pytest exit {result.returncode})"
        return f"{verdict} {name}: {' '.join(tests)}\n{result.stdout[-1500:]}"


def main():
    wanted = sys.argv[1:]
    bugs = [bug for bug in BUGS if not wanted or any(w in bug[0] for w in wanted)]
    lines = []
    for bug in bugs:
        line = plant(*bug)
        print(line, flush=True)
        lines.append(line)
    caught = sum(line.startswith("CAUGHT") for line in lines)
    print(f"plant_bugs: {caught} of {len(lines)} caught")
    sys.exit(0 if caught == len(lines) else 1)


if __name__ == "__main__":
    main()

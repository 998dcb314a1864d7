"""train.data_parallel=fsdp for real, on 2 gloo ranks under torchrun: sharded initialisation (equal to DDP's, and each
rank's peak memory at the start under the bound), FSDP's losses against DDP's (Muon and AdamW), each rank's half of
the weights and of the optimizer's state, a kill -9 in the middle of a sharded save and the bit-exact resume after it, a
resume on 1 process and a DDP checkpoint resumed as FSDP, the sharded checkpoint read by every reader (sample.py,
export-hf, compare-state, list, the bucket), and each refusal. The runs are made once for the module (torchrun's
start-up is most of their time)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TINY, assert_one_sentence, read_metrics, run_in_process, run_train

# One pytest worker runs this file's tests (pytest.ini's --dist loadgroup): they share the module fixture's runs.
pytestmark = pytest.mark.xdist_group("fsdp")

# 6 steps of 2 micro-steps per rank (the gradient sync skipped on the first), evaluated, checkpointed and sampled at
# step 3 (a mid-run sample: every rank's metrics must still line up) and at the end.
# Muon (the quick start's optimizer; AdamW takes the embeddings, gains and biases beside it), so every test below holds
# for Muon's gathered update and AdamW's sharded one at once.
COMMON = TINY + ["--train.max_steps=6", "--train.total_batch_size=512", "--eval.interval=3",
                 "--checkpoint.interval=3", "--eval.sample_interval=3", "--eval.sample_tokens=4",
                 "--eval.num_samples=1", "--optim.name=muon"]
FSDP = "--train.data_parallel=fsdp"


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *map(str, args)]


def bucket():
    """moto's S3 server, when s3fs and moto are installed (the FSDP run then uploads its checkpoints)."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        return None
    from bucket_fixture import start_s3
    return start_s3()


@pytest.fixture(scope="module")
def runs(data_root, tmp_path_factory):
    """{name: run folder}, with "s3": the bucket's environment (or None) and "killed": the output of the killed run."""
    base = tmp_path_factory.mktemp("fsdp")
    common = [*COMMON, f"--data.data_root={data_root}"]
    found = {name: base / name for name in ("ddp", "fsdp", "killed", "one", "ddp_to_fsdp")}
    found["ddp_output"] = run_train([*common, f"--train.out_dir={found['ddp']}", "--log.all_ranks=true"],
                                    nproc=2).stdout
    store = bucket()
    with store if store is not None else open(os.devnull) as env:
        s3 = env if store is not None else None
        remote = ["--checkpoint.remote_folder=s3://runs/fsdp"] if s3 else []
        found["fsdp_output"] = run_train([*common, FSDP, f"--train.out_dir={found['fsdp']}",
                                          "--checkpoint.async_save=true", "--checkpoint.unsharded_interval=6",
                                          *remote], nproc=2, env=s3 or {}).stdout
        if s3:  # what the bucket holds, and the model read back from it (downloaded: every file its marker lists)
            import checkpoint
            from lab import remote as bucket_files
            fs, root = bucket_files.filesystem("s3://runs/fsdp")
            fs.invalidate_cache()
            found["bucket_listing"] = sorted(path[len(root) + 1:] for path in fs.find(root))
            found["from_bucket"] = checkpoint.load_model("s3://runs/fsdp/step6", "cpu", "--init_from").state_dict()
        # kill -9 of every rank while they write the pieces of step 6 (each says so in a file of its own)
        notes = base / "saving_notes"
        notes.mkdir()
        process = subprocess.Popen(torchrun(ROOT / "tests" / "fsdp_killed_in_a_save.py", *common, FSDP,
                                            f"--train.out_dir={found['killed']}"), cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                                        "SAVING_NOTES": str(notes)})
        deadline = time.monotonic() + 300
        while len(list(notes.glob("*.json"))) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        held = {int(path.stem): json.loads(path.read_text()) for path in notes.glob("*.json")}
        for rank in held.values():  # every rank (torchrun starts them in sessions of their own), then torchrun
            os.kill(rank["pid"], signal.SIGKILL)
        os.killpg(process.pid, signal.SIGKILL)
        try:
            found["killed_output"] = process.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:  # a rank that never said it was saving still holds the pipe
            found["killed_output"] = "(no output: a rank did not stop)"
        assert len(held) == 2, found["killed_output"]
        found["held"] = held
        found["after_the_kill"] = (sorted(os.listdir(found["killed"])), os.listdir(found["killed"] / "step6.partial"))
        shutil.copytree(found["killed"], found["one"], symlinks=True)
        found["resumed_output"] = run_train([*common, FSDP, f"--train.out_dir={found['killed']}"], nproc=2).stdout
        found["one_output"] = run_train([*common, f"--train.out_dir={found['one']}"]).stdout  # 1 process, DDP
        shutil.copytree(found["ddp"], found["ddp_to_fsdp"], symlinks=True)
        run_train([*common, FSDP, f"--train.out_dir={found['ddp_to_fsdp']}", "--checkpoint.resume_step=3"], nproc=2)
        found["s3"] = s3
        yield found


def column(out_dir, name):
    return {row["step"]: row[name] for row in read_metrics(out_dir) if name in row}


# 25.5M parameters (97 MB in fp32) in 8 blocks and a small vocabulary, so that the largest tensor (4 MB) is small beside
# the whole: the bound then sits well under a whole build. docs/fsdp.md measures 124M and 354M models the same way.
START_MODEL = ["--model.n_layer=8", "--model.n_head=8", "--model.n_embd=512", "--model.block_size=64",
               "--model.vocab_size=512"]


def test_sharded_initialisation_equals_ddps_and_no_rank_holds_the_whole_model():
    result = subprocess.run(torchrun(ROOT / "tests" / "fsdp_start.py", "fsdp", *START_MODEL), cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(rank["rank"] for rank in ranks) == [0, 1]
    for rank in ranks:
        assert rank["equal"] is True  # bit for bit, every tensor
        assert rank["peak_mb"] <= rank["bound_mb"] < rank["whole_mb"], rank


def test_fsdp_trains_as_ddp_does(runs):
    ddp, fsdp = column(runs["ddp"], "train/loss"), column(runs["fsdp"], "train/loss")
    assert sorted(ddp) == sorted(fsdp) == [1, 2, 3, 4, 5, 6]
    assert min(ddp.values()) > 10  # every rank's metrics lined up after the mid-run sample (no rank's row dropped)
    assert max(abs(ddp[step] - fsdp[step]) for step in ddp) <= 1e-5
    val_ddp, val_fsdp = column(runs["ddp"], "val/loss"), column(runs["fsdp"], "val/loss")
    assert sorted(val_ddp) == [3, 6] and max(abs(val_ddp[s] - val_fsdp[s]) for s in val_ddp) <= 1e-5
    # The global gradient norm, from each rank's pieces; float32 norms over the 1.6M-number embedding differ in
    # their last digits from DDP's (docs/checkpoints-and-reliability.md).
    norm_ddp, norm_fsdp = column(runs["ddp"], "train/grad_norm"), column(runs["fsdp"], "train/grad_norm")
    assert all(abs(norm_ddp[s] - norm_fsdp[s]) <= 1e-3 * norm_ddp[s] for s in norm_ddp)
    assert (runs["fsdp"] / "samples.txt").read_text().count("--- step") == 2  # rank 0 wrote them, once each


def test_log_all_ranks_prints_each_other_ranks_own_line(runs):
    # Found anywhere in the output: the two ranks share it, and rank 0's text may be cut where rank 1's line lands.
    steps = re.findall(r"\[rank 1\] step +(\d+) \| loss ", runs["ddp_output"])
    assert steps == [str(step) for step in range(1, 7)]  # log.interval=1: one line a step
    assert not any(line.startswith("[rank ") for line in runs["fsdp_output"].splitlines())  # off by default


def test_each_rank_holds_half_of_the_weights_and_of_the_optimizer_state(runs):
    assert sorted(runs["held"]) == [0, 1]
    for held in runs["held"].values():
        assert abs(held["weights"] / held["all_weights"] - 0.5) < 0.01
        assert abs(held["moments"] / held["all_moments"] - 0.5) < 0.01


def test_a_sharded_checkpoint_is_atomic_checksummed_and_async(runs):
    from checkpoint import MARKER, find_checkpoints, verify_checkpoint

    step3, step6 = runs["fsdp"] / "step3", runs["fsdp"] / "step6"
    marker = json.loads((step3 / MARKER).read_text())
    assert sorted(marker["files"]) == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp",
                                       "trainer.pt"]
    assert not (step3 / "model.pt").exists()  # nothing gathered on one rank
    # checkpoint.unsharded_interval=6: step 6 also holds the whole model.pt, under the marker's checksums
    assert sorted(json.loads((step6 / MARKER).read_text())["files"]) == [
        "model.pt", "sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp", "trainer.pt"]
    verify_checkpoint(step6)
    assert "checkpoint step6 (permanent, async)" in runs["fsdp_output"]
    assert "with FSDP on 2 rank(s)" in runs["fsdp_output"]  # the memory estimate, said at the start
    broken = runs["fsdp"].parent / "broken"
    shutil.copytree(step6, broken)
    with open(broken / "sharded" / "__1_0.distcp", "r+b") as f:
        f.write(b"x")
    with pytest.raises(Exception, match="does not match its checksum"):
        verify_checkpoint(broken)
    # the killed save left pieces in step6.partial, never a step6: the resumes start from step 3
    names, partial = runs["after_the_kill"]
    assert "step3" in names and "step6.partial" in names and "step6" not in names
    assert partial == ["sharded"]
    assert [step for step, _ in find_checkpoints(runs["killed"])] == [3, 6]


def test_a_kill_during_a_sharded_save_resumes_bit_exact_on_two_ranks(runs):
    assert "resumed from" in runs["resumed_output"] and "step3 at step 3" in runs["resumed_output"]
    assert column(runs["killed"], "train/loss") == column(runs["fsdp"], "train/loss")
    assert column(runs["killed"], "val/loss") == column(runs["fsdp"], "val/loss")


def test_a_two_rank_sharded_checkpoint_resumes_on_one_process(runs):
    assert "resumed from" in runs["one_output"]
    one, fsdp = column(runs["one"], "train/loss"), column(runs["fsdp"], "train/loss")
    assert sorted(one) == [1, 2, 3, 4, 5, 6]
    assert max(abs(one[step] - fsdp[step]) for step in (4, 5, 6)) <= 1e-5


def test_a_ddp_checkpoint_resumes_as_fsdp(runs):
    resumed, ddp = column(runs["ddp_to_fsdp"], "train/loss"), column(runs["ddp"], "train/loss")
    assert max(abs(resumed[step] - ddp[step]) for step in (4, 5, 6)) <= 1e-5
    assert (runs["ddp_to_fsdp"] / "step6" / "sharded").is_dir() and (runs["ddp"] / "step6" / "model.pt").exists()


def test_every_reader_reads_a_sharded_checkpoint(runs, tmp_path):
    import checkpoint
    from lab import debug
    import sample
    from lab.fsdp import read_tensors

    listed = run_in_process(["list", str(runs["fsdp"])], checkpoint.main)
    assert "step6" in listed.stdout and "complete" in listed.stdout
    sampled = run_in_process(["--init_from", str(runs["fsdp"]), "--num_samples=1", "--max_new_tokens=4",
                              "--device=cpu"], sample.main)
    assert sampled.returncode == 0 and "sample 0" in sampled.stdout, sampled.stderr
    model = checkpoint.load_model(str(runs["fsdp"]), "cpu", "--init_from")  # step6's model.pt (unsharded_interval)
    pieces = read_tensors(str(runs["fsdp"] / "step6" / "sharded"))
    whole = torch.load(runs["fsdp"] / "step6" / "model.pt", weights_only=True)
    assert whole.keys() == pieces.keys() and all(torch.equal(whole[name], pieces[name]) for name in pieces)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in pieces.items())
    from_pieces = checkpoint.load_model(str(runs["fsdp"] / "step3"), "cpu", "--init_from")  # no model.pt there
    assert all(torch.equal(from_pieces.state_dict()[name], tensor)
               for name, tensor in read_tensors(str(runs["fsdp"] / "step3" / "sharded")).items())
    compared = run_in_process(["compare-state", str(runs["ddp"] / "step6"), str(runs["fsdp"] / "step6")], debug.main)
    # the same 84 tensors by name (weights and AdamW moments) on both sides; they differ where clipping did (above)
    assert "Traceback" not in compared.stderr and "only in" not in compared.stdout, compared.stdout + compared.stderr
    assert "differ" in compared.stdout and "optim/transformer.wpe.weight/exp_avg_sq" in compared.stdout
    transformers = pytest.importorskip("transformers")
    exported = run_in_process(["export-hf", str(runs["fsdp"]), str(tmp_path / "hf")], checkpoint.main)
    assert exported.returncode == 0, exported.stderr
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(idx).logits, model(idx)[..., :50257], atol=1e-4)


def test_the_bucket_holds_a_sharded_checkpoint_and_gives_it_back(runs):
    if runs["s3"] is None:
        pytest.skip("s3fs and moto are not installed (pip install s3fs 'moto[server]')")
    import checkpoint

    assert {"step6/COMPLETE", "step6/trainer.pt", "step6/sharded/.metadata", "step6/sharded/__0_0.distcp",
            "step6/sharded/__1_0.distcp"} <= set(runs["bucket_listing"])
    local = checkpoint.load_model(str(runs["fsdp"] / "step6"), "cpu", "--init_from").state_dict()
    assert local.keys() == runs["from_bucket"].keys()
    assert all(torch.equal(local[name], runs["from_bucket"][name]) for name in local)


def run_code_instead_of_metadata(checkpoint_dir, marker_file):
    """Replace checkpoint_dir's sharded/.metadata with a pickle that runs `touch marker_file` when unpickled, and
    recompute the checksums in COMPLETE, as anyone handing over a checkpoint can."""
    import hashlib
    import pickle

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker_file}",)

    (checkpoint_dir / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload()))
    marker = json.loads((checkpoint_dir / "COMPLETE").read_text())
    marker["files"] = {name: hashlib.sha256((checkpoint_dir / name).read_bytes()).hexdigest()
                       for name in marker["files"]}
    (checkpoint_dir / "COMPLETE").write_text(json.dumps(marker))


def test_a_sharded_metadata_that_runs_code_is_refused_by_every_entry_point(runs, data_root, tmp_path):
    import checkpoint
    from lab import debug
    import hellaswag_eval
    import sample
    import train

    crafted, ran = tmp_path / "crafted", tmp_path / "the_payload_ran"
    shutil.copytree(runs["fsdp"], crafted, symlinks=True)
    for step in crafted.glob("step[0-9]*"):
        run_code_instead_of_metadata(step, ran)
    common = [*COMMON, f"--data.data_root={data_root}"]
    own = tmp_path / "own"  # the crafted run as a run folder to resume
    shutil.copytree(crafted, own, symlinks=True)
    calls = [(sample.main, ["--init_from", crafted, "--num_samples=1", "--max_new_tokens=2", "--device=cpu"]),
             (hellaswag_eval.main, ["--init_from", crafted, "--device=cpu"]),
             (train.main, [*common, f"--train.out_dir={tmp_path / 'a'}", f"--checkpoint.load_path={crafted}"]),
             (train.main, [*common, f"--train.out_dir={tmp_path / 'b'}", "--stage2.start=3steps",
                           f"--stage2.reference={crafted}"]),
             (train.main, [*common, f"--train.out_dir={own}"]),
             (checkpoint.main, ["export-hf", crafted, tmp_path / "hf"]),
             (debug.main, ["compare-state", crafted / "step6", runs["fsdp"] / "step6"])]
    if runs["s3"]:  # the same checkpoint from a bucket
        from lab import remote
        fs, root = remote.filesystem("s3://runs/crafted")
        fs.put(str(crafted / "step6"), f"{root}/step6", recursive=True)
        calls += [(sample.main, ["--init_from", "s3://runs/crafted", "--device=cpu"]),
                  (train.main, [*common, f"--train.out_dir={tmp_path / 'c'}",
                                "--checkpoint.load_path=s3://runs/crafted/step6"]),
                  (train.main, [*common, f"--train.out_dir={tmp_path / 'd'}",  # a fresh node resuming the bucket's
                                "--checkpoint.remote_folder=s3://runs/crafted"])]
    before = sorted(os.listdir(own))
    for main, args in calls:
        result = run_in_process(args, main)
        assert_one_sentence(result, "sharded/.metadata is not the metadata torch.distributed.checkpoint writes "
                                    "(it asks to run posix.system)")
        assert not ran.exists(), (args, result.stdout)
    assert sorted(os.listdir(own)) == before and not (tmp_path / "a").exists() and not (tmp_path / "hf").exists()


def test_sharded_files_that_pass_their_checksums_but_hold_no_checkpoint_are_one_sentence(runs, data_root, tmp_path):
    import hashlib

    import sample
    import train

    def rewrite_marker(checkpoint_dir, drop=()):
        marker = json.loads((checkpoint_dir / "COMPLETE").read_text())
        marker["files"] = {name: hashlib.sha256((checkpoint_dir / name).read_bytes()).hexdigest()
                           for name in marker["files"] if name not in drop}
        (checkpoint_dir / "COMPLETE").write_text(json.dumps(marker))

    noise = tmp_path / "noise" / "step6"  # random bytes as .metadata: stage2.reference is refused at the start
    shutil.copytree(runs["fsdp"] / "step6", noise)
    (noise / "sharded" / ".metadata").write_bytes(os.urandom(256))
    rewrite_marker(noise)
    result = run_in_process([*COMMON, f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}",
                             "--stage2.start=3steps", f"--stage2.reference={noise}"], train.main)
    assert_one_sentence(result, "stage2.reference", "sharded/.metadata is not the metadata", "no pickle DCP wrote")
    assert not (tmp_path / "run").exists()
    gone = tmp_path / "gone" / "step6"  # a rank's piece deleted and taken out of the marker
    shutil.copytree(runs["fsdp"] / "step6", gone)
    (gone / "sharded" / "__1_0.distcp").unlink()
    rewrite_marker(gone, drop={"sharded/__1_0.distcp"})
    result = run_in_process(["--init_from", gone, "--device=cpu"], sample.main)
    assert_one_sentence(result, "names __1_0.distcp, which", "does not list (a piece deleted after the save)")


@pytest.mark.parametrize("setting, phrase", [
    ([], "this is a plain python process"),
    (["--stage2.start=3steps"], "cannot run with stage2.start"),
    (["--debug.trace_steps=2"], "cannot run with debug.trace_steps"),
    (["--log.activations_interval=2"], "cannot run with log.activations_interval"),
])
def test_what_fsdp_cannot_honour_is_one_sentence_before_anything_is_written(data_root, tmp_path, setting, phrase):
    out = tmp_path / "run"
    result = run_train([*COMMON, f"--data.data_root={data_root}", FSDP, f"--train.out_dir={out}", *setting],
                       check=False)
    assert_one_sentence(result, phrase)
    assert not out.exists()


def doctor_metadata(checkpoint_dir, change):
    """Apply `change` to checkpoint_dir's sharded/.metadata (DCP's Metadata) and its first piece's _StorageInfo, then
    recompute the marker, so that every file passes its checksum."""
    import hashlib
    import pickle

    from lab.fsdp import read_metadata
    metadata = read_metadata(checkpoint_dir / "sharded")
    index = sorted(metadata.storage_data, key=lambda index: index.fqn)[0]
    change(metadata, metadata.storage_data[index], checkpoint_dir)
    (checkpoint_dir / "sharded" / ".metadata").write_bytes(pickle.dumps(metadata))
    marker = json.loads((checkpoint_dir / "COMPLETE").read_text())
    names = {*marker["files"], *(f"sharded/{info.relative_path}" for info in metadata.storage_data.values())}
    marker["files"] = {name: hashlib.sha256(open(os.path.join(checkpoint_dir, name), "rb").read()).hexdigest()
                       for name in names}  # a path outside is listed too: only the check on the path refuses it
    (checkpoint_dir / "COMPLETE").write_text(json.dumps(marker))


def leave_by_absolute_path(metadata, info, checkpoint_dir):
    outside = checkpoint_dir.parent / "outside.distcp"
    shutil.copy(checkpoint_dir / "sharded" / info.relative_path, outside)
    decoy = checkpoint_dir / "sharded" / outside.relative_to("/")  # what the marker's checksum reads
    decoy.parent.mkdir(parents=True)
    shutil.copy(outside, decoy)
    info.relative_path = str(outside)


def leave_by_dots(metadata, info, checkpoint_dir):
    shutil.copy(checkpoint_dir / "sharded" / info.relative_path, checkpoint_dir.parent / "outside.distcp")
    info.relative_path = "../../outside.distcp"


def set_field(name, value):
    return lambda metadata, info, checkpoint_dir: setattr(info, name, value)


def weights_as(dtype):
    def change(metadata, info, checkpoint_dir):
        for key, meta in metadata.state_dict_metadata.items():
            if key.startswith("model.") and hasattr(meta, "properties"):
                meta.properties.dtype = dtype
    return change


def a_pickle_for_a_piece(metadata, info, checkpoint_dir):
    """The first piece's file replaced by a plain pickle of the same length, which DCP hands to torch.load."""
    import pickle
    piece = checkpoint_dir / "sharded" / info.relative_path
    size, filler = piece.stat().st_size, piece.stat().st_size - 64
    while len(pickle.dumps(b"x" * filler)) < size:
        filler += 1
    piece.write_bytes(pickle.dumps(b"x" * filler))


@pytest.mark.parametrize("change, phrase", [
    (leave_by_dots, "outside sharded/"),
    (leave_by_absolute_path, "outside sharded/"),
    (set_field("offset", -1000), "at offset -1000,"),
    (set_field("length", 10**15), "length 1000000000000000 of __"),
    (set_field("transform_descriptors", ["os.system"]), "asks for transforms ['os.system']"),
    (weights_as(torch.int8), "as torch.int8, which this trainer never saves"),
    (weights_as(torch.bfloat16), "as torch.bfloat16 and this model as torch.float32, which a load would cast"),
    (a_pickle_for_a_piece, "cannot be read (UnpicklingError), so they are not loaded"),
])
def test_a_sharded_metadata_that_reads_outside_its_pieces_or_holds_hostile_values_is_one_sentence(
        runs, data_root, tmp_path, change, phrase):
    import sample
    import train
    step = tmp_path / "run" / "step6"
    shutil.copytree(runs["fsdp"] / "step6", step)
    (step / "model.pt").unlink()  # the pieces alone, which every reader then reads (sample.py too)
    marker = json.loads((step / "COMPLETE").read_text())
    del marker["files"]["model.pt"]
    (step / "COMPLETE").write_text(json.dumps(marker))
    doctor_metadata(step, change)
    before = sorted(os.listdir(tmp_path / "run"))
    result = run_in_process([*COMMON, f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'out'}",
                             f"--checkpoint.load_path={step}", "--train.max_steps=7"], train.main)
    assert_one_sentence(result, phrase)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("step*"))
    assert_one_sentence(run_in_process(["--init_from", step, "--device=cpu"], sample.main), phrase)  # one process
    assert sorted(os.listdir(tmp_path / "run")) == before


@pytest.mark.parametrize("kind, extra", [("ddp", []), ("fsdp", [FSDP, "--checkpoint.async_save=true"])])
def test_a_full_disk_during_a_save_on_two_ranks_says_which_step_is_intact_and_leaves_nothing_behind(
        runs, data_root, tmp_path, kind, extra):
    """Every file capped at 1 MB, a disk that fills up: the weights cannot be written (FSDP: every rank's pieces
    either), the metrics can. Rank 0 says it in one sentence (no rank's traceback); the failed step's partial
    folder, which holds the disk's space, and its metrics snapshot, which names a checkpoint that never was, are
    gone, and the step before is whole."""
    import checkpoint
    out = tmp_path / "run"
    shutil.copytree(runs[kind], out, symlinks=True)  # the run as it was after step 3
    shutil.rmtree(out / "step6")
    (out / "latest").unlink()
    (out / "latest").symlink_to("step3")

    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    broken = subprocess.run(torchrun(ROOT / "train.py", *COMMON, f"--data.data_root={data_root}", *extra,
                                     f"--train.out_dir={out}"), cwd=ROOT, capture_output=True, text=True,
                            preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert broken.returncode != 0 and "step      6 |" in broken.stdout, broken.stdout + broken.stderr
    assert "[rank" not in broken.stderr and "Traceback (most recent call last): (RANK" not in broken.stderr
    ours = [line for line in broken.stderr.splitlines() if line.startswith("error")]
    reason = "File too large" if kind == "ddp" else "rank(s) 0, 1: a file was cut short, as on a full disk"
    assert ours[0] == (f"error: saving the checkpoint of step 6 in {out} failed ({reason}); step3 is intact: "
                       "free disk space, then run the same command again to resume."), broken.stderr
    assert all("lost its connection to another rank" in line for line in ours[1:]), broken.stderr
    assert sorted(name for name in os.listdir(out) if name.startswith(("step", "metrics_step"))) == [
        "metrics_step3.json", "step3"]
    checkpoint.verify_checkpoint(str(out / "step3"))


def test_the_loops_tasks_score_under_fsdp_as_on_one_process(data_root, tmp_path):
    """Every rank scores every example under FSDP, through score_tokens, which gathers the root's weights as forward
    does (FSDP hooks forward alone): the same scores as one process gives after the same two steps."""
    from conftest import tiny_task_data

    common = [*TINY, f"--data.data_root={data_root}", "--train.max_steps=2", "--train.total_batch_size=256",
              "--eval.interval=0", "--eval.tasks=hellaswag", "--eval.tasks_interval=1", "--eval.tasks_limit=8",
              f"--eval.tasks_data_dir={tiny_task_data()}"]
    run_train([*common, f"--train.out_dir={tmp_path / 'one'}"])
    run_train([*common, FSDP, f"--train.out_dir={tmp_path / 'fsdp'}"], nproc=2)
    one, fsdp = (read_metrics(tmp_path / name)[-1] for name in ("one", "fsdp"))
    scores = [name for name in one if name.startswith("eval/")]
    assert "eval/hellaswag/loss" in scores and scores == [name for name in fsdp if name.startswith("eval/")]
    assert all(abs(one[name] - fsdp[name]) <= 1e-4 for name in scores), (one, fsdp)

"""vLLM's own server as the one engine (common/engine/serve.py, common/engine/engines.py ServerEngine): the command
lines it is started with, in-place reloads checked by the weights (checksums, a measured probe
tolerance, a stale engine caught), stages on several servers, and the faults a stage must name (a
server that dies, never starts, is unreachable or serves other weights, a port in use); against a
stand-in HTTP server, what only GPUs run (the probe on each data-parallel engine, engines whose
checksums differ, a data-parallel server without /server_info, the wake order, a failed sleep); a
state file whose pid is another process."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest

from common import presets
from common.engine import serve
from common.engine.engines import make_engine
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import play
from common.jsonl import RecordError, read_json, write_json
from common.train import memplan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_IDS = ["multi_turn_base_105", "multi_turn_miss_func_146", "multi_turn_miss_param_100",
            "multi_turn_long_context_100"]
GREEDY = dict(temperature=0.0, max_new_tokens=24, max_steps_per_turn=2)


@pytest.fixture(scope="module")
def tasks():
    by_id = bfcl.load_tasks(os.path.join(ROOT, "data", "train.jsonl"))
    return [by_id[i] for i in TASK_IDS]


# ----------------------------------------------------------------------------- command lines


def preset_settings(name, *sets):
    """A GPU preset's engine settings as loop.sh passes them: DP, TP, sleep mode, the context it
    serves (memplan.server_len of the model's config.json numbers) and, with LORA, the rank."""
    p = presets.resolve(name, sets)
    context = memplan.server_len(p.max_len, p.eval_len, memplan.load_arch(p.model).max_pos)
    return dict(data_parallel_size=int(p.dp), tensor_parallel_size=int(p.tp), sleep_mode=True, max_model_len=context,
                **({"lora_rank": presets.LORA_RANK} if p.lora else {}))


# every GPU preset of common/presets.py, and one trained as a LoRA adapter
PRESETS = {name: preset_settings(name) for name, p in presets.PRESETS.items() if p.gpu_mem_gib}
PRESETS["qwen7b-lora"] = preset_settings("qwen7b", "LORA=--lora")


def test_gpu_command_lines_are_vllm_serve_with_the_presets_settings():
    argv, env = serve.command("/m/qwen7b", port=8000, cpu=False, seed=3, **PRESETS["qwen7b"])
    assert argv == [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", "/m/qwen7b",
                    "--host", "127.0.0.1", "--port", "8000", "--served-model-name", "policy", "--seed", "3",
                    "--dtype", "auto", "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching",
                    "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
                    "--worker-extension-cls", "common.engine.serve.WorkerExtension", "--max-model-len", "32768",
                    "--data-parallel-size", "4", "--gpu-memory-utilization", "0.9", "--enable-sleep-mode"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_NO_USAGE_STATS"] == "1"  # no report to vLLM's stats service from a user's cluster
    assert env["PYTHONPATH"].split(os.pathsep)[0] == ROOT  # where vLLM's workers import the extension from
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env  # vLLM refuses it beside its 4 default API servers
    # LoRA: one API server, the one that registers each adapter and so the one every request reaches
    argv, env = serve.command("/m/toolace", port=8000, cpu=False, **PRESETS["qwen7b-lora"])
    assert argv == [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", "/m/toolace",
                    "--host", "127.0.0.1", "--port", "8000", "--served-model-name", "policy", "--seed", "0",
                    "--dtype", "auto", "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching",
                    "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
                    "--worker-extension-cls", "common.engine.serve.WorkerExtension", "--max-model-len", "32768",
                    "--data-parallel-size", "4", "--gpu-memory-utilization", "0.9", "--enable-sleep-mode", "--enable-lora", "--max-lora-rank", "16",
                    "--max-loras", "1", "--api-server-count", "1"]
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    argv, env = serve.command("/m/toolace", port=8000, cpu=False, lora_rank=16)  # one engine: one API server
    assert argv[-9:] == ["--worker-extension-cls", "common.engine.serve.WorkerExtension", "--gpu-memory-utilization", "0.9",
                         "--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"]
    cpu, env = serve.command("/m/tiny", port=9, cpu=True, max_model_len=16384)
    assert cpu[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/tiny"]
    assert cpu[-3:] == ["--enforce-eager", "--distributed-executor-backend", "uni"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")  # no spinning engine threads
    with pytest.raises(RecordError, match="one CPU engine"):
        serve.command("/m/tiny", port=9, cpu=True, data_parallel_size=2)


def test_every_flag_is_one_the_installed_vllm_parses():
    """vLLM's own argument parser (the installed vllm-cpu 0.32; vllm 0.33 on GPUs takes the same
    serve flags) accepts every command line the launcher builds."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    for name, settings in PRESETS.items():
        argv, env = serve.command(f"/m/{name}", port=8000, cpu=False, **settings)
        args = parser.parse_args(argv[2:])
        assert args.model_tag == f"/m/{name}" and args.data_parallel_size == 4 and args.enable_sleep_mode
        assert args.logprobs_mode == "processed_logprobs" and args.enable_prefix_caching
        assert args.worker_extension_cls == serve.WORKER_EXTENSION
        # `vllm serve` starts data_parallel_size API servers unless told (vllm/entrypoints/cli/serve.py:125),
        # and refuses run-time adapter loading with more than one (serve.py:315)
        api_servers = args.api_server_count or args.data_parallel_size
        assert api_servers == (1 if settings.get("lora_rank") else 4)
        assert not (api_servers > 1 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in env)
    argv, _ = serve.command("/m/tiny", port=9, cpu=True, max_model_len=16384)
    args = parser.parse_args(argv[3:])
    assert args.model == "/m/tiny" and args.distributed_executor_backend == "uni" and args.enforce_eager


@pytest.mark.parametrize("gpus", ["1", "2", "8"])
@pytest.mark.parametrize("lora", ["", "--lora"])
def test_gpus_k_serves_on_k_engines_asleep_while_training(gpus, lora):
    """GPUS=K as loop.sh starts the server (SERVE_ARGS from the preset: DP, TP, LoRA's rank, sleep mode
    on GPUs): K data-parallel engines (one GPU: one engine, no data-parallel flag), sleep mode, and a
    LoRA policy as a run-time adapter through one API server; every line one the installed vLLM parses."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from common.presets import LORA_RANK, resolve

    p = resolve("qwen3-4b", [f"GPUS={gpus}", f"LORA={lora}"])
    argv, env = serve.command("/m/qwen3-4b", port=8000, cpu=False, max_model_len=262144, tensor_parallel_size=int(p.tp),
                              data_parallel_size=int(p.dp), lora_rank=LORA_RANK if p.lora else None, sleep_mode=True)
    dp = [] if gpus == "1" else ["--data-parallel-size", gpus]
    adapter = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"] if lora else []
    one_api_server = ["--api-server-count", "1"] if lora and gpus != "1" else []
    # the share the memory plan counts (common/train/memplan.py VLLM_UTILIZATION), not vLLM's default 0.92
    assert argv[argv.index("--max-model-len"):] == ["--max-model-len", "262144", *dp, "--gpu-memory-utilization", "0.9",
                                                    "--enable-sleep-mode", *adapter,
                                                    *one_api_server]
    assert (env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "True") == bool(lora)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    assert args.enable_sleep_mode and args.data_parallel_size == int(gpus) and bool(args.enable_lora) == bool(lora)
    assert (args.api_server_count or args.data_parallel_size) == (1 if lora else int(gpus))


# ----------------------------------------------------------------------------- reload and check


@pytest.fixture(scope="module")
def other_policy(tiny_model, tmp_path_factory):
    """A copy of the tiny model with every weight moved, and the trainer's probe of it (probe.json)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = str(tmp_path_factory.mktemp("other"))
    shutil.copytree(tiny_model, out, dirs_exist_ok=True)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out)
    write_json(os.path.join(out, serve.PROBE), probe_of(model, out))
    return out


def probe_of(model, folder):
    import torch
    from transformers import AutoTokenizer

    ids = serve.probe_ids(AutoTokenizer.from_pretrained(folder))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return {"ids": ids, "logprobs": lp.tolist(), "dtype": "float32"}


def test_reload_serves_the_new_policy_and_the_check_reads_its_weights(tiny_server, tiny_server_state, tiny_model,
                                                                       other_policy, tasks, tmp_path, capfd):
    before, _ = play.play(tasks[:2], 1, make_engine("vllm", tiny_model, max_model_len=16384, servers=[tiny_server]),
                          play.PlaySpec(**GREEDY), progress=False)
    with pytest.raises(RecordError, match=f"serves {tiny_model}, not {other_policy}"):
        make_engine("vllm", other_policy, max_model_len=16384, servers=[tiny_server])
    serve.reload([tiny_server], other_policy, tiny_server_state)
    serve.check(tiny_server, other_policy)  # the label and the probe's log-probabilities
    engine = make_engine("vllm", other_policy, max_model_len=16384, servers=[tiny_server])
    after, _ = play.play(tasks[:2], 1, engine, play.PlaySpec(**GREEDY), progress=False)
    hf, _ = play.play(tasks[:2], 1, make_engine("hf", other_policy, max_model_len=16384), play.PlaySpec(**GREEDY),
                      progress=False)
    assert [r["tokens"]["ids"][:8] for r in after] == [r["tokens"]["ids"][:8] for r in hf]
    assert [r["tokens"]["ids"] for r in after] != [r["tokens"]["ids"] for r in before]
    # A probe that the server's weights do not give is refused, whatever the label says.
    probe = read_json(os.path.join(other_policy, serve.PROBE))
    bad = dict(probe, logprobs=[x - 0.5 for x in probe["logprobs"]])
    write_json(os.path.join(other_policy, serve.PROBE), bad)
    try:
        with pytest.raises(RecordError, match="its weights are not"):
            serve.check(tiny_server, other_policy)
    finally:
        write_json(os.path.join(other_policy, serve.PROBE), probe)
    # A round that moved the weights by less than the probe can see (as a few small AdamW steps
    # do): labelled without a load, the server still holds the old bytes, which its checksums show.
    nudged = nudge(other_policy, str(tmp_path / "nudged"), probe["logprobs"])
    stale = serve.server_logprobs(tiny_server, "policy", probe["ids"])
    assert serve.probe_gap(stale, read_json(os.path.join(nudged, serve.PROBE))["logprobs"])[0] < serve.PROBE_TOL["float32"]
    serve.request(tiny_server, "/update_weight_version", {"new_version": serve.policy_label(nudged)})
    with pytest.raises(RecordError, match="holds the previous policy's bytes of .* tensors the trainer changed"):
        serve.check(tiny_server, nudged)
    serve.request(tiny_server, "/update_weight_version", {"new_version": serve.policy_label(other_policy)})
    capfd.readouterr()
    serve.reload([tiny_server], nudged, tiny_server_state)  # measures the tolerance on other_policy, then loads
    tol = read_json(os.path.join(nudged, serve.PROBE))["tolerance"]
    assert tol["model"] == other_policy and tol["noise"] < 1e-3
    assert tol["value"] == pytest.approx(serve.PROBE_K * tol["noise"] + serve.PROBE_FLOOR["float32"])
    log = capfd.readouterr().err
    assert f"{tiny_server} {nudged}: probe mean |Δ log p| " in log and "tensors as in the files" in log, log


def nudge(policy, out, start_logprobs):
    """A copy of `policy` moved by a relative 1e-5 (every float32 weight changes), with the probe
    and weights record train_grpo.py writes for a round that started from `policy`."""
    import types

    import torch
    from transformers import AutoModelForCausalLM

    import train_grpo

    shutil.copytree(policy, out)
    model = AutoModelForCausalLM.from_pretrained(policy)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-5)
    model.save_pretrained(out)
    record = train_grpo.weights_record(types.SimpleNamespace(model=policy), out, start_logprobs)
    assert record["previous"] and set(record["previous"]) <= set(record["sha256"])
    write_json(os.path.join(out, serve.PROBE), probe_of(model, out) | record)
    return out


def test_reload_command_line_and_a_check_before_any_output(tiny_server, other_policy, tmp_path, tiny_model):
    out = tmp_path / "r.jsonl"
    res = subprocess.run([sys.executable, "rollout.py", "--model", other_policy, "--tasks", "data/train.jsonl",
                          "--task-ids", TASK_IDS[0], "--n", "1", "--server", tiny_server, "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode != 0 and f"serves {tiny_model}, not {other_policy}" in res.stderr and not out.exists()
    for bad in ("localhost:8000", "http://127.0.0.1", "ftp://h:1"):
        res = subprocess.run([sys.executable, "rollout.py", "--model", tiny_model, "--tasks", "data/train.jsonl",
                              "--n", "1", "--server", bad, "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
        assert res.returncode != 0 and "is not http://HOST:PORT" in res.stderr and not out.exists()
    with socket.socket() as s:  # a port nobody answers on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = subprocess.run([sys.executable, "-m", "common.engine.serve", "check", "--server", f"http://127.0.0.1:{port}",
                          "--model", tiny_model], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode != 0 and f"server http://127.0.0.1:{port} does not answer" in res.stderr


def test_lora_adapter_loads_at_run_time(tiny_server, tiny_model, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                                LoraConfig(r=8, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    adapter = str(tmp_path / "lora")
    peft_model.save_pretrained(adapter)
    subprocess.run([sys.executable, "-m", "common.engine.serve", "reload", "--server", tiny_server, "--model", adapter],
                   cwd=ROOT, check=True)
    assert serve.check(tiny_server, adapter) == serve.lora_name(adapter)
    prompt = [[5, 6, 7, 8, 9, 10]]
    (base,) = make_engine("vllm", tiny_model, max_model_len=512, servers=[tiny_server]).generate(prompt, [16], 0.0)
    (lora,) = make_engine("vllm", adapter, max_model_len=512, servers=[tiny_server]).generate(prompt, [16], 0.0)
    (hf,) = make_engine("hf", adapter, max_model_len=512).generate(prompt, [16], 0.0)
    assert lora.ids[:8] == hf.ids[:8]
    n = min(len(lora.ids), len(hf.ids), 8)
    assert max(abs(a - b) for a, b in zip(lora.logprobs[:n], hf.logprobs[:n], strict=True)) < 1e-3
    assert (lora.ids, lora.logprobs) != (base.ids, base.logprobs)  # the adapter, not the base, answered


@pytest.fixture(scope="module")
def tied_policies(tiny_model, tmp_path_factory):
    """Two policies of the tiny model with its output layer tied to its embeddings, as Qwen2.5-3B's
    and Qwen3-4B-Instruct-2507's are (no lm_head.weight in the files): A, and B with every weight
    moved; each with the trainer's probe, B's with A's digests of the tensors it changed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model)
    config.tie_word_embeddings = True
    weights = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    weights.pop("lm_head.weight")
    root, folders = tmp_path_factory.mktemp("tied"), []
    for name, noise in (("a", 0.0), ("b", 0.02)):
        folder = str(root / name)
        shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("*.safetensors", serve.PROBE))
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        model.save_pretrained(folder)
        probe = probe_of(model, folder) | {"sha256": serve.file_digests(folder)}
        assert "lm_head.weight" not in probe["sha256"] and serve.tied(folder)
        if folders:
            old = serve.file_digests(folders[-1])
            probe["previous"] = {n: old[n] for n, d in probe["sha256"].items() if old[n] != d}
        write_json(os.path.join(folder, serve.PROBE), probe)
        folders.append(folder)
    return folders


def test_a_tied_model_reloads_in_place_as_a_fresh_server_serves_it(tied_policies, tmp_path, capfd):
    """A model whose output layer is its embeddings reloads in place, no restart, and then serves
    what a fresh server on the same policy serves: the probe's log-probabilities and /weight_checker's
    checksums equal, bit for bit. vLLM's own reload alone (vllm-cpu 0.32) leaves the output layer
    computing with the weights the server started with: the probe sees it, the checksums cannot."""
    a, b = tied_policies
    state_path = str(tmp_path / "server.json")
    state = serve.start(b, str(tmp_path / "server.log"), max_model_len=4096)
    write_json(state_path, state)
    url, ids = state["url"], read_json(os.path.join(b, serve.PROBE))["ids"]

    def serving():
        return serve.server_logprobs(url, "policy", ids), serve.checksums(url)

    try:
        fresh = serving()
        serve.reload([url], a, state_path)
        serve.request(url, "/collective_rpc", {"method": "reload_weights",
                                               "kwargs": {"weights_path": b, "is_checkpoint_format": True}})
        stale = serving()
        assert stale[1] == fresh[1] and serve.probe_gap(stale[0], fresh[0])[1] > 0.1
        capfd.readouterr()
        serve.reload([url], b, state_path)
        assert f"{url} loaded {b} in place" in capfd.readouterr().err
        assert read_json(state_path)["pid"] == state["pid"]  # the same server
        assert serving() == fresh
    finally:
        serve.stop(state_path)


# ----------------------------------------------------------------------------- several servers, faults


def test_one_stage_on_two_servers_pins_trajectories_and_gives_the_same_records(tiny_server, second_server,
                                                                                tiny_model, tasks):
    one = make_engine("vllm", tiny_model, max_model_len=16384, servers=[tiny_server])
    single, _ = play.play(tasks, 1, one, play.PlaySpec(schedule="async", **GREEDY), progress=False)
    two = make_engine("vllm", tiny_model, max_model_len=16384, servers=[tiny_server, second_server["url"]])
    served, submit = {}, two.submit

    def watch(key, *a):  # which server each request of a trajectory went to
        submit(key, *a)
        served.setdefault(key, set()).add(two.slots[two.pins[key]][0])

    two.submit = watch
    recs, timing = play.play(tasks, 1, two, play.PlaySpec(schedule="async", **GREEDY), progress=False)
    assert all(len(s) == 1 for s in served.values())  # a trajectory stays on its server
    assert sorted(min(s) for s in served.values()) == sorted([tiny_server] * 2 + [second_server["url"]] * 2)
    assert not two.pins and not two.pending and timing["cached_tokens"] > 0
    for a, b in zip(recs, single, strict=True):
        assert a["tokens"]["ids"] == b["tokens"]["ids"] and a["tokens"]["mask"] == b["tokens"]["mask"]


def test_a_server_that_dies_mid_stage_fails_it_naming_the_server_and_its_log(second_server, tiny_model, tmp_path):
    out = tmp_path / "r.jsonl"
    proc = subprocess.Popen([sys.executable, "rollout.py", "--model", tiny_model, "--tasks", "data/train.jsonl",
                             "--task-ids", ",".join(TASK_IDS), "--n", "4", "--max-new-tokens", "96",
                             "--server", second_server["url"], "--server-log", second_server["log"],
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while _served_tokens(second_server["url"]) == 0:  # until its trajectories are playing
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.5)
    os.killpg(second_server["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-2000:]
    assert second_server["url"] in err and second_server["log"] in err
    assert not out.exists()


def _served_tokens(url):
    """Prompt tokens the server has processed so far (its Prometheus counter)."""
    import urllib.request
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:prompt_tokens_total"):
                return float(line.split()[-1])
    return 0


def test_start_faults_are_clear_errors(tiny_model, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(RecordError, match=f"port {port} on 127.0.0.1 is in use"):
            serve.start(tiny_model, str(tmp_path / "a.log"), port=port)
    with pytest.raises(RecordError, match=r"not healthy after 1 s \(log .*b.log\)"):
        serve.start(tiny_model, str(tmp_path / "b.log"), timeout=1)


def test_start_stop_and_reuse_through_the_state_file(tiny_server_state, tiny_model):
    state = read_json(tiny_server_state)
    before = json.dumps(state)
    # `start` on a state file whose server runs with the same settings reuses it (no new process)
    res = subprocess.run([sys.executable, "-m", "common.engine.serve", "start", "--model", tiny_model,
                          "--state", tiny_server_state, "--log", state["log"], "--max-model-len",
                          str(state["settings"]["max_model_len"]),
                          "--lora-rank", "16"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == state["url"] and json.dumps(read_json(tiny_server_state)) == before


# ----------------------------------------------------------------------------- a stand-in for vLLM's GPU endpoints


class FakeVLLM:
    """A real HTTP server answering the endpoints common/engine/serve.py uses as vLLM's server does, for what
    only GPUs run (data-parallel engines, sleep mode): it records every request (method, path, the
    data-parallel rank header) and serves the probe's log-probabilities, shifted on `bad_ranks`."""

    def __init__(self, policy, *, dp=1, label=None, sleeping=False, bad_ranks=(), sleep_fails=False, sums=None,
                 no_info=False, extension=True):
        import http.server
        import threading

        self.probe = read_json(os.path.join(policy, serve.PROBE))
        self.dp, self.label, self.asleep = dp, label, {"weights", "kv_cache"} if sleeping else set()
        self.bad_ranks, self.sleep_fails, self.seen = set(bad_ranks), sleep_fails, []
        self.sums, self.no_info = sums, no_info  # /weight_checker's checksums (None: no such endpoint)
        self.extension, self.rpcs = extension, []  # started with common.engine.serve's worker extension; RPCs called
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.answer(None)

            def do_POST(self):
                self.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null"))

            def answer(self, body):
                rank = self.headers.get("X-data-parallel-rank")
                fake.seen.append((self.command, self.path, rank))
                code, out = fake.route(self.path, body, rank)
                raw = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def route(self, path, body, rank):
        if path == "/v1/models":
            return 200, {"data": [{"id": "policy", "root": "/elsewhere", "max_model_len": 4096}]}
        if path == "/weight_info":
            return 200, {"weight_version": self.label}
        if path == "/server_info" and self.no_info:
            return 500, {"error": "Internal Server Error"}
        if path == "/weight_checker":
            return (404, {"detail": "Not Found"}) if self.sums is None else (200, {"checksums": self.sums})
        if path == "/server_info":  # vLLM's config as its one repr string
            return 200, {"vllm_config": f"model='/m', data_parallel_size={self.dp}, device_config=cuda, seed=0"}
        if path == "/is_sleeping":
            return 200, {"is_sleeping": bool(self.asleep)}
        if path == "/v1/completions":
            shift = 0.5 if rank is not None and int(rank) in self.bad_ranks else 0.0
            rows = [None] + [{str(i): {"logprob": lp + shift}}
                             for i, lp in zip(self.probe["ids"][1:], self.probe["logprobs"], strict=True)]
            return 200, {"choices": [{"prompt_logprobs": rows}]}
        if path.startswith("/sleep?level="):
            if self.sleep_fails:
                return 500, {"error": "CUDA error: out of memory"}
            self.asleep = {"weights", "kv_cache"}
            return 200, {"status": "sleeping", "level": int(path[-1])}
        if path.startswith("/wake_up"):
            tags = urllib.parse.parse_qs(urllib.parse.urlparse(path).query).get("tags")
            self.asleep -= set(tags or self.asleep)
            return 200, {"status": "sleeping" if self.asleep else "awake"}
        if path == "/update_weight_version":
            self.label = body["new_version"]
        if path == "/collective_rpc":
            self.rpcs.append(body["method"])
            if body["method"] == "refresh_tied_layers":
                if not self.extension:  # vLLM's answer, read off vllm-cpu 0.32
                    return 500, {"error": {"message": "Call to collective_rpc method failed: Method "
                                           "'refresh_tied_layers' is not implemented.", "code": 500}}
                return 200, {"results": [["model.embed_tokens", "lm_head"]] * self.dp}
        return 200, {}

    def posts(self):
        return [(path, rank) for method, path, rank in self.seen if method == "POST"]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def policy(tmp_path):
    """A full-model policy folder as train_grpo.py writes it, as far as a server check reads it."""
    folder = tmp_path / "policy"
    folder.mkdir()
    write_json(str(folder / "config.json"), {"tie_word_embeddings": False})
    write_json(str(folder / serve.PROBE), {"ids": [11, 12, 13, 14, 15], "logprobs": [-1.5, -0.25, -3.0, -0.5],
                                           "dtype": "bfloat16"})
    return str(folder)


@pytest.fixture
def fake_vllm(policy):
    servers = []

    def make(**kw):
        servers.append(FakeVLLM(policy, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_the_probe_reads_every_data_parallel_engine_and_names_the_one_that_differs(policy, fake_vllm):
    label = serve.policy_label(policy)
    good = fake_vllm(dp=4, label=label)
    assert serve.check(good.url, policy) == "policy"
    assert good.posts() == [("/weight_checker", None)] + [("/v1/completions", r) for r in ("0", "1", "2", "3")]
    stale = fake_vllm(dp=4, label=label, bad_ranks={2})
    with pytest.raises(RecordError, match="its weights are not") as e:
        serve.check(stale.url, policy)
    assert "on data-parallel rank 2 of 4 by 0.5 on average" in str(e.value)
    assert "rank 0" not in str(e.value) and "rank 1" not in str(e.value) and "rank 3" not in str(e.value)
    one = fake_vllm(dp=1, label=label)  # one engine: no header, vLLM's own routing
    serve.check(one.url, policy)
    assert one.posts() == [("/weight_checker", None), ("/v1/completions", None)]


def test_engines_whose_checksums_differ_are_named_and_a_missing_server_info_fails_a_data_parallel_check(policy,
                                                                                                      fake_vllm):
    label = serve.policy_label(policy)
    sums = {f"dp{r}:pp0:pcp0:tp0:model.norm.weight": "a" for r in range(4)}
    assert serve.check(fake_vllm(dp=4, label=label, sums=sums).url, policy) == "policy"
    one_behind = fake_vllm(dp=4, label=label, sums=sums | {"dp2:pp0:pcp0:tp0:model.norm.weight": "b"})
    with pytest.raises(RecordError, match="engines dp0 and dp2 hold different weights .1 tensors, e.g. pp0:pcp0:tp0"):
        serve.check(one_behind.url, policy)
    # a server whose /server_info fails: one engine where none was asked for, else a clear error after a retry
    mute = fake_vllm(dp=4, label=label, no_info=True)
    assert serve.server_info(mute.url) == {"device": None, "data_parallel_size": 1}
    with pytest.raises(RecordError, match=f"server {mute.url}: /server_info answered 500.*4 data-parallel engines"):
        serve.check(mute.url, policy, data_parallel_size=4)
    assert [p for m, p, _ in mute.seen if p == "/server_info"] == ["/server_info"] * 3  # once; with DP 4 asked, twice


def test_a_reload_wakes_the_weights_loads_then_wakes_the_kv_cache(policy, fake_vllm):
    asleep = fake_vllm(dp=4, label="seal:/the/last/policy", sleeping=True)
    serve.reload([asleep.url], policy)
    assert asleep.posts() == [("/wake_up?tags=weights", None), ("/collective_rpc", None),
                              ("/update_weight_version", None), ("/wake_up?tags=kv_cache", None),
                              ("/reset_prefix_cache", None), ("/weight_checker", None)] + [
                                  ("/v1/completions", r) for r in ("0", "1", "2", "3")]
    assert not asleep.asleep and asleep.label == serve.policy_label(policy)
    # asleep with the policy's own label (a rerun after a failed train step): woken and loaded, not
    # taken for serving it, and not probed before its weights are back
    same = fake_vllm(dp=4, label=serve.policy_label(policy), sleeping=True)
    serve.reload([same.url], policy)
    assert same.posts() == asleep.posts() and not same.asleep
    awake = fake_vllm(label="seal:/the/last/policy")  # no sleep mode: nothing to wake
    serve.load(awake.url, policy)
    assert [p for p, _ in awake.posts()] == ["/collective_rpc", "/update_weight_version", "/reset_prefix_cache"]


def test_a_tied_policy_refreshes_its_output_layer_and_a_server_without_the_extension_is_named(policy, fake_vllm):
    write_json(os.path.join(policy, "config.json"), {"tie_word_embeddings": True})
    ok = fake_vllm(dp=4, label="seal:/the/last/policy")
    serve.reload([ok.url], policy)
    assert ok.rpcs == ["reload_weights", "refresh_tied_layers"] and ok.label == serve.policy_label(policy)
    bare = fake_vllm(label="seal:/the/last/policy", extension=False)  # a server a user started without it
    with pytest.raises(RecordError, match=r"answered 500.*ties its output layer to its embeddings: an in-place "
                                          r"load needs the server started with --worker-extension-cls "
                                          r"common\.engine\.serve\.WorkerExtension"):
        serve.reload([bare.url], policy)
    assert bare.label == "seal:/the/last/policy"  # not labelled with a policy it may not serve


def test_a_sleep_that_fails_fails_the_command_naming_the_server(policy, fake_vllm, tmp_path):
    state = str(tmp_path / "server.json")
    ok = fake_vllm()
    write_json(state, {"url": ok.url, "pid": 0})
    res = subprocess.run([sys.executable, "-m", "common.engine.serve", "sleep", "--state", state], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert ok.posts() == [("/sleep?level=2", None)]
    # a LoRA server keeps its base weights (in CPU memory): the adapter loaded on wake needs them
    lora = fake_vllm()
    write_json(state, {"url": lora.url, "pid": 0, "settings": {"lora_rank": 16}})
    res = subprocess.run([sys.executable, "-m", "common.engine.serve", "sleep", "--state", state], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0 and lora.posts() == [("/sleep?level=1", None)], res.stderr
    failing = fake_vllm(sleep_fails=True)
    with socket.socket() as s:  # a port nobody answers on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    for url, why in ((failing.url, f'server {failing.url}: /sleep?level=2 answered 500: {{"error": "CUDA error: out'),
                     (dead, f"server {dead} does not answer /sleep?level=2 (")):
        write_json(state, {"url": url, "pid": 0})
        res = subprocess.run([sys.executable, "-m", "common.engine.serve", "sleep", "--state", state], cwd=ROOT,
                             capture_output=True, text=True)
        assert res.returncode != 0
        assert f"error: the server at {url} (state {state}) did not go to sleep and still holds its GPUs: {why}" \
            in res.stderr, res.stderr


def test_stop_leaves_alone_a_process_that_took_the_recorded_pid(tmp_path):
    state = str(tmp_path / "server.json")
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a group leader, as a server is
    try:
        now = serve.started(other.pid)
        boot, ticks = now.split()
        write_json(state, {"url": "http://127.0.0.1:1", "pid": other.pid, "started": f"{boot} {int(ticks) - 1}"})
        serve.stop(state)
        assert other.poll() is None and not os.path.exists(state)  # alive, and the stale file gone
        write_json(state, {"url": "http://127.0.0.1:1", "pid": other.pid, "started": f"another-boot {ticks}"})
        serve.stop(state)
        assert other.poll() is None
        write_json(state, {"url": "http://127.0.0.1:1", "pid": other.pid, "started": now})  # the recorded one
        serve.stop(state)
        other.wait(timeout=30)  # reaped here, or by stop itself (then no status is left to read)
        assert serve.started(other.pid) != now
    finally:
        other.kill()
        other.wait()

"""/metrics and /slots of a real server serving two models (issue 49), and the speculation
counters (issue 50): every per-model sample carries ``model``, each family has one HELP and
TYPE, each model's request counters equal what its clients received, the set's own state and
bytes agree with /v1/models, and the bundled model's n-gram drafts are counted (drafted =
accepted + rejected) while the tiny model, which may not speculate, counts none. The one-model
exposition (no ``model`` label) is checked in process against the engine's own speculation
counts."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import slotserve as ss
from slotserve.bench.processes import ServerProcess, free_port
from slotserve.server import create_app
from slotserve.testing import write_tiny_gguf

MODELS_TOML = """
[models.spec]
source = "bundled"
weights = "gguf"   # block halves on the compiled kernels: speculation keeps the output exact
max_seqs = 2
max_context = 512

[models.plain]
source = "{plain}"  # fp32 halves: speculation is refused (it could change the output)
max_seqs = 3
max_context = 128
"""
BUDGET = 4 << 30
COUNT = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"  # a greedy count the bundled model continues
SPECULATION = ("drafted_tokens", "accepted_tokens", "rejected_tokens", "steps")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[Samples, dict[str, str]]:
    """/metrics parsed by prometheus_client's own parser: each sample by name and labels,
    and each family's type. A family declared twice (two HELP or TYPE lines) fails here."""
    text = httpx.get(url + "/metrics", timeout=30).text
    for marker in ("# HELP ", "# TYPE "):
        declared = [line.split()[2] for line in text.splitlines() if line.startswith(marker)]
        assert len(declared) == len(set(declared)), f"a family declared twice: {declared}"
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def complete(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model
    return dict(reply.json())


@pytest.fixture(scope="module")
def two_models(
    tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    models_file = tmp_path_factory.mktemp("model-metrics") / "models.toml"
    models_file.write_text(MODELS_TOML.format(plain=tiny_dirs["llama"]))
    port = free_port()
    command = [sys.executable, "-m", "slotserve.cli", "serve", "--models", str(models_file)]
    command += ["--port", str(port), "--memory-budget", str(BUDGET)]
    server = ServerProcess(command, port)
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


def test_each_models_counters_equal_what_its_clients_received(two_models: ServerProcess) -> None:
    url = two_models.url
    before, _ = scrape(url)
    jobs = [("spec", COUNT, 12), ("spec", "Say hello.", 7), ("spec", COUNT, 20)]
    jobs += [("plain", "ab", 5), ("plain", "a b c", 9), ("plain", "x", 16), ("plain", "y", 3)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: complete(url, *job), jobs))
    after, types = scrape(url)
    for model in ("spec", "plain"):
        mine = [r["usage"] for (name, *_), r in zip(jobs, replies, strict=True) if name == model]
        generated = sum(usage["completion_tokens"] for usage in mine)

        def delta(name: str, model: str = model) -> float:
            return value(after, name, model=model) - value(before, name, model=model)

        assert delta("slotserve_generated_tokens_total") == generated
        assert delta("slotserve_time_to_first_token_seconds_count") == len(mine)
        assert delta("slotserve_request_duration_seconds_count") == len(mine)
        # one inter-token gap per delivered token after the first, drafts accepted or not
        assert delta("slotserve_inter_token_latency_seconds_count") == generated - len(mine)
        ended = sum(
            v - before.get(key, 0.0)
            for key, v in after.items()
            if key[0] == "slotserve_requests_finished_total" and ("model", model) in key[1]
        )
        assert ended == len(mine)
    # every engine family holds both models, each with its own reading
    assert value(after, "slotserve_max_seqs", model="spec") == 2
    assert value(after, "slotserve_max_seqs", model="plain") == 3
    for model in ("spec", "plain"):
        assert value(after, "slotserve_slots_in_use", model=model) == 0
        assert value(after, "slotserve_kv_pool_bytes", model=model) > 0
        assert value(after, "slotserve_queue_length", model=model) == 0
    assert types["slotserve_generated_tokens"] == "counter"
    assert types["slotserve_max_seqs"] == "gauge"


def test_the_sets_state_and_bytes_agree_with_v1_models(two_models: ServerProcess) -> None:
    samples, types = scrape(two_models.url)
    listed = httpx.get(two_models.url + "/v1/models", timeout=30).json()["data"]
    cards = {card["id"]: card["slotserve"] for card in listed}
    assert set(cards) == {"spec", "plain"}
    for model, card in cards.items():
        assert value(samples, "slotserve_model_planned_bytes", model=model) == card["bytes"] > 0
        assert value(samples, "slotserve_model_resident_bytes", model=model) == card["bytes"]
        assert value(samples, "slotserve_model_state", model=model, state="loaded") == 1
        assert value(samples, "slotserve_model_state", model=model, state="unloaded") == 0
        assert value(samples, "slotserve_model_loads_total", model=model) == card["loads"] == 1
        info = value(samples, "slotserve_model_info", model=model, kind="generate", resident="true")
        assert info == 1
    shared = value(samples, "slotserve_models_shared_bytes")
    used = value(samples, "slotserve_models_used_bytes")
    assert used == shared + sum(card["bytes"] for card in cards.values())
    assert value(samples, "slotserve_models_required_bytes") == used  # both resident
    assert used <= value(samples, "slotserve_models_budget_bytes") == BUDGET
    # the plan's arenas are every model's, named MODEL.ARENA
    arena = "slotserve_plan_arena_bytes"
    arenas = {dict(labels)["arena"] for name, labels in samples if name == arena}
    assert {"spec.weights", "spec.kv", "plain.weights", "plain.kv"} <= arenas
    assert types["slotserve_model_loads"] == "counter"
    # per-model families carry the label; the process's and the connections' do not
    for name, labels in samples:
        keys = dict(labels)
        if name.startswith(("slotserve_process_", "slotserve_connections_", "slotserve_models_")):
            assert "model" not in keys, name
        elif name.startswith(("slotserve_model_", "slotserve_speculation_", "slotserve_kv_")):
            assert keys["model"] in cards, (name, keys)


def test_speculation_counters_count_the_drafts(two_models: ServerProcess) -> None:
    url = two_models.url
    before, _ = scrape(url)
    reply = complete(url, "spec", COUNT, 40)
    assert reply["choices"][0]["text"].startswith(" 3, 4, 1, 2, 3, 4")  # the count goes on
    complete(url, "plain", COUNT, 12)
    after, types = scrape(url)

    def delta(name: str, model: str) -> float:
        return value(after, f"slotserve_speculation_{name}", model=model) - value(
            before, f"slotserve_speculation_{name}", model=model
        )

    drafted, accepted, rejected, steps = (delta(f"{n}_total", "spec") for n in SPECULATION)
    assert drafted > 0 and accepted > 0 and steps > 0
    assert drafted == accepted + rejected
    assert steps <= drafted
    assert value(after, "slotserve_speculation_enabled", model="spec") == 1
    # the tiny model runs fp32 halves, where the engine refuses to speculate: all 0
    assert value(after, "slotserve_speculation_enabled", model="plain") == 0
    for name in SPECULATION:
        assert value(after, f"slotserve_speculation_{name}_total", model="plain") == 0
        assert types[f"slotserve_speculation_{name}"] == "counter"
    totals = [value(after, f"slotserve_speculation_{n}_total", model="spec") for n in SPECULATION]
    assert totals[0] == totals[1] + totals[2]


def test_slots_list_each_model_and_filter_by_name(two_models: ServerProcess) -> None:
    url = two_models.url
    # Sampled free text, long: it is still decoding while /slots is read three times.
    body = {
        "model": "spec", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
        "temperature": 1.0, "seed": 7, "stream": True,
    }  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as stream:
        lines = stream.iter_lines()
        assert any(line.startswith("data: {") for line in lines)  # spec is decoding now
        listed = httpx.get(url + "/slots", timeout=30)
        assert listed.status_code == 200
        slots = listed.json()
        assert [s["model"] for s in slots] == ["spec"] * 2 + ["plain"] * 3
        busy = [(s["model"], s["slot"]) for s in slots if s["state"] != "idle"]
        assert len(busy) == 1 and busy[0][0] == "spec"
        assert "x-kv-blocks-used" not in listed.headers  # one engine's headers: ?model=
        one = httpx.get(url + "/slots", params={"model": "plain"}, timeout=30)
        assert one.status_code == 200
        assert [s["model"] for s in one.json()] == ["plain"] * 3
        assert all(s["state"] == "idle" for s in one.json())
        assert one.headers["x-kv-blocks-used"] == "0"
        spec = httpx.get(url + "/slots", params={"model": "spec"}, timeout=30)
        assert int(spec.headers["x-kv-blocks-used"]) >= 1
        assert [(s["model"], s["slot"]) for s in spec.json() if s["state"] != "idle"] == busy
    unknown = httpx.get(url + "/slots", params={"model": "nope"}, timeout=30)
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'spec'" in error["message"] and "'plain'" in error["message"]


# -- one model: no label, the engine's own counts -------------------------------------------


def test_one_model_shows_the_engines_speculation_counts_unlabelled(
    tmp_path: Path,
) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny-q4_1.gguf", "llama", "Q4_1")
    model = ss.load(gguf, weights="gguf", progress=False)
    engine = ss.Engine(model, ss.EngineConfig(max_seqs=1, max_context=128, speculate="ngram"))
    client = TestClient(create_app(engine, "tiny", web=False))
    with client:
        params = ss.SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        engine.submit([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], params).result()
        speculation = engine.stats().speculation
        assert speculation is not None  # block halves on the kernels: it drafts
        text = client.get("/metrics").text
        samples = {
            (s.name, tuple(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples[("slotserve_speculation_enabled", ())] == 1
        for name in SPECULATION:
            expected = getattr(speculation, name.removesuffix("_tokens"))
            assert samples[(f"slotserve_speculation_{name}_total", ())] == expected
        assert speculation.drafted == speculation.accepted + speculation.rejected
        assert samples[("slotserve_generated_tokens_total", ())] == 24
        assert not any("model" in dict(labels) for _, labels in samples)
        slots = client.get("/slots", params={"model": "tiny"})
        assert slots.status_code == 200 and "model" not in slots.json()[0]
        assert client.get("/slots", params={"model": "other"}).status_code == 404

"""Tests of the load profiles as data: each profile's own settings, validated with file:line in
matrix.yaml, seeded prompts, and the traffic shapes the profiles promise (partial prefix reuse
ending at every block boundary, conversations that grow turn by turn)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvrepro.errors import SpecError
from kvrepro.loadgen import get_profile, known_profiles
from kvrepro.loadgen.capacity import engine_capacity
from kvrepro.loadgen.profiles import EngineCapacity
from kvrepro.matrix import parse_matrix
from kvrepro.spec.matrix import LoadSpec

ROOT = Path(__file__).resolve().parent.parent
CAPACITY = EngineCapacity(gpu_tokens=1404, block_tokens=16, chunk_tokens=16, max_model_len=1024)
MATRIX_HEAD = 'base: "0.26.0"\nbuilds:\n  A: []\nload:\n'


def prompts(profile: str, n: int, seed: int = 0, **settings) -> list:
    p = get_profile(profile)(LoadSpec(profile=profile, **settings), seed, CAPACITY)
    return [p.prompt(i) for i in range(n)]


def test_every_profile_is_a_file_with_its_own_settings():
    assert {"partial-prefix", "multi-turn", "shared_prefix"} <= set(known_profiles())
    for cls in known_profiles().values():
        assert cls.Settings.model_config.get("extra") == "forbid"


def test_partial_prefix_is_the_default():
    assert LoadSpec().profile == "partial-prefix"


@pytest.mark.parametrize("profile", ["partial-prefix", "multi-turn", "shared_prefix", "sibling-burst"])
def test_prompts_are_a_function_of_seed_and_index(profile):
    a = prompts(profile, 60, seed=3)
    b = get_profile(profile)(LoadSpec(profile=profile), 3, CAPACITY)
    assert [b.prompt(i).tokens for i in reversed(range(60))] == [p.tokens for p in reversed(a)]
    assert [p.tokens for p in prompts(profile, 60, seed=4)] != [p.tokens for p in a]
    assert all(p.tokens and len(p.tokens) + p.max_tokens <= 1024 for p in a)


def test_revisit_uses_every_family_deep_pass_pass_then_shallow_then_again():
    """The default schedule: deep(i), pass(i) x 2, shallow(i-1), again(i-1); the crash needs this order.

    The pass uses ask about the body's last two chunks (up to L - chunk and up to L, each + a new
    question of at least two chunks): each one's local hit ends at a state `again` needs, and it
    computes past it, so the state is offloaded whatever a release stores (docs/defect-family.md 4)."""
    ps = prompts("partial-prefix", 500)
    assert [p.fields["phase"] for p in ps[:11]] == ["deep", "pass", "pass", "deep", "pass", "pass", "shallow",
                                                   "again", "deep", "pass", "pass"]
    by_family: dict[int, list] = {}
    for p in ps:
        by_family.setdefault(p.fields["family"], []).append(p)
    complete = [uses for uses in by_family.values() if len(uses) == 5]
    assert len(complete) >= 95
    for deep, near, end, shallow, again in complete:
        assert [u.fields["phase"] for u in (deep, near, end, shallow, again)] == \
            ["deep", "pass", "pass", "shallow", "again"]
        body = deep.tokens
        assert len(body) % 16 == 0 and len(shallow.tokens) % 16 == 0  # both end on a KV block boundary
        assert shallow.tokens == body[:len(shallow.tokens)] and len(shallow.tokens) < len(body)
        assert again.tokens[:len(body)] == body and len(again.tokens) > len(body)  # + a fresh suffix
        for use, depth in ((near, len(body) - 16), (end, len(body))):
            assert use.fields["reused_tokens"] == depth and use.tokens[:depth] == body[:depth]
            assert use.tokens[depth:depth + 32] != body[depth:depth + 32]  # a new question, not the body
            assert 2 * 16 + 1 <= use.fields["suffix_tokens"] <= 2 * 16 + 8
            assert len(use.tokens) + use.max_tokens <= 1024  # the question fits the engine
    assert len({len(s.tokens) // 16 for _, _, _, s, _ in complete}) >= 15  # shallow depths at many blocks
    assert {"documents", "agent_transcripts"} <= {p.fields["kind"] for p in ps}
    without = prompts("partial-prefix", 7, pass_through=False)
    assert [p.fields["phase"] for p in without] == ["deep", "deep", "shallow", "again", "deep", "shallow", "again"]


def test_revisit_sizes_bodies_from_the_gpu_cache_and_the_engine_limit():
    def lengths(gpu_tokens, **settings):
        cap = EngineCapacity(gpu_tokens=gpu_tokens, block_tokens=16, chunk_tokens=16, max_model_len=1 << 16)
        p = get_profile("partial-prefix")(LoadSpec(**settings), 0, cap)
        return [len(q.tokens) for q in map(p.prompt, range(60)) if q.fields["phase"] == "deep"]

    small, big = lengths(1000), lengths(8000)
    assert all(0.85 * 600 - 16 <= n <= 1.15 * 600 for n in small)  # family_share 0.6 of 1000 tokens
    assert all(0.85 * 4800 - 16 <= n <= 1.15 * 4800 for n in big)
    assert max(lengths(1000, family_share=0.3)) < min(small)
    offload = EngineCapacity(gpu_tokens=8000, offload_tokens=2000, block_tokens=16, max_model_len=1 << 16)
    in_offload = get_profile("partial-prefix")(LoadSpec(), 0, offload)
    bodies = [q.fields["reused_tokens"] for q in map(in_offload.prompt, range(30)) if q.fields["phase"] == "deep"]
    assert max(bodies) <= 0.8 * 2000 / 2 * 1.15
    capped = get_profile("partial-prefix")(LoadSpec(max_tokens=8), 0, CAPACITY)  # max_model_len 1024
    assert all(len(capped.prompt(i).tokens) + 8 <= 1024 for i in range(200))


@pytest.mark.parametrize("align,unit", [("block", 16), ("chunk", 64)])
def test_reused_parts_end_on_the_align_unit(align, unit):
    cap = EngineCapacity(gpu_tokens=1404, block_tokens=16, chunk_tokens=64, max_model_len=1024)
    p = get_profile("partial-prefix")(LoadSpec(align=align), 0, cap)
    ends = {p.prompt(i).fields["reused_tokens"] % unit for i in range(120)}
    assert ends == {0}


def test_random_schedule_reuses_families_to_every_block_position():
    ps = prompts("partial-prefix", 400, schedule="random", align="none")
    kinds = {p.fields["kind"] for p in ps}
    assert {"documents", "agent_transcripts"} <= kinds
    ends = {p.fields["reused_tokens"] % 16 for p in ps if p.fields["kind"] == "documents"}
    assert len(ends) >= 12  # the reused part ends at (nearly) every position inside a block
    depths = {p.fields["reused_tokens"] // 16 for p in ps}
    assert len(depths) >= 30  # ... of many different blocks


def test_random_schedule_pressure_is_sized_from_the_gpu_cache():
    def make(**cap):
        return get_profile("partial-prefix")(LoadSpec(schedule="random"), 0, EngineCapacity(**cap))

    small, big = make(gpu_tokens=1000, max_model_len=1024), make(gpu_tokens=8000, max_model_len=1024)
    total = lambda p: sum(len(f.body) for f in p.families)  # noqa: E731
    assert total(small) >= 1.7 * 1000 and total(big) >= 1.7 * 8000
    assert len(big.families) > len(small.families)
    capped = make(gpu_tokens=8000, offload_tokens=4000)
    assert total(capped) < total(big)  # families must stay in the offload tier


def test_agent_transcripts_grow_with_every_use():
    ps = [p for p in prompts("partial-prefix", 300, schedule="random", mix={"agent_transcripts": 1})
          if p.fields["family"] == 0]
    reused = [p.fields["reused_tokens"] for p in ps]
    assert sum(b > a for a, b in zip(reused, reused[1:])) >= len(reused) * 0.6


@pytest.mark.parametrize("dist", [{"dist": "constant", "chunks": 5}, {"dist": "uniform"},
                                  {"dist": "lognormal", "median_chunks": 4}, {"dist": "zipf"}])
@pytest.mark.parametrize("schedule", ["random", "revisit"])
def test_depth_distributions(dist, schedule):
    ps = prompts("partial-prefix", 300, mix={"documents": 1}, depth=dist, schedule=schedule)
    chunks = [p.fields["reused_tokens"] // 16 for p in ps
              if p.fields["phase"] in ("reuse", "shallow")]
    if dist["dist"] == "constant":
        assert set(chunks) <= {5}
    elif dist["dist"] == "zipf":
        assert sorted(chunks)[len(chunks) // 2] <= 8  # most reuse is shallow
    else:
        assert len(set(chunks)) > 5


def test_multi_turn_conversations_grow_turn_by_turn():
    ps = prompts("multi-turn", 200, conversations=3)
    by_session: dict[int, list] = {}
    for p in ps:
        by_session.setdefault(p.fields["session"], []).append(p)
    grown = 0
    for turns in by_session.values():
        for earlier, later in zip(turns, turns[1:]):
            assert later.tokens[:len(earlier.tokens)] == earlier.tokens  # the whole conversation so far
            grown += 1
    assert grown > 100
    assert max(len(p.tokens) for p in ps) <= 900


def test_sibling_burst_sends_identical_siblings_together_after_their_parent():
    """Per family: a busy request, the parent, then the siblings as one burst (the runner sends a
    prompt carrying ``burst: n`` and the next n-1 at once); families share no tokens."""
    ps = prompts("sibling-burst", 10, siblings=3, parent_tokens=170, sibling_tokens=240)
    busy, parent, first, *rest = ps[:5]
    assert [p.fields["role"] for p in ps[:6]] == ["busy", "parent", "sibling", "sibling", "sibling", "busy"]
    assert busy.max_tokens == 64 and len(busy.tokens) == 32
    assert len(parent.tokens) == 170 and first.tokens[:170] == parent.tokens and len(first.tokens) == 240
    assert first.events.burst == 3 and all(p.tokens == first.tokens and not p.events.burst for p in rest)
    assert busy.events is None and parent.events is None  # load.events still apply to them
    assert ps[6].fields == {"family": 1, "role": "parent"} and ps[6].tokens[:16] != parent.tokens[:16]
    with pytest.raises(ValueError, match="sibling_tokens must exceed parent_tokens"):
        prompts("sibling-burst", 1, parent_tokens=240, sibling_tokens=240)


@pytest.mark.parametrize("load_yaml,line,message", [
    ("  profile: partial-prefix\n  pressure: -1\n", 6, "load.pressure: Input should be greater than 0"),
    ("  profile: partial-prefix\n  depth: {dist: constant}\n", 6, "load.depth"),
    ("  profile: multi-turn\n  documents: 3\n", 6, "load.documents: unknown field (not a setting of profile 'multi-turn')"),
    ("  profile: no-such\n", 5, "load.profile: unknown profile 'no-such'"),
    ("  arrival: poisson\n", 5, "load.arrival: poisson needs rate_rps"),
])
def test_profile_settings_errors_name_file_line_and_field(tmp_path, load_yaml, line, message):
    path = tmp_path / "matrix.yaml"
    with pytest.raises(SpecError) as err:
        parse_matrix(MATRIX_HEAD + load_yaml, path)
    assert f"{path}:{line}: {message}" in str(err.value)


def test_matrix_validate_reports_a_bad_profile_setting_without_traceback(tmp_path):
    path = tmp_path / "matrix.yaml"
    path.write_text(MATRIX_HEAD + "  profile: partial-prefix\n  suffix_tokens: [9, 2]\n")
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "validate", "-m", str(path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert f"{path}:6: load.suffix_tokens: suffix_tokens must be [low, high]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_shipped_matrix_uses_the_default_profile(default_matrix):
    assert default_matrix.matrix.load.profile == "partial-prefix"


def test_capacity_from_the_engine_log_unless_the_matrix_gives_it():
    log = "INFO [kv_cache_utils.py:2177] GPU KV cache size: 1,404 tokens\n"
    cap = engine_capacity(LoadSpec(), log, block_size=16, max_model_len=1024)
    assert (cap.gpu_tokens, cap.block_tokens, cap.chunk_tokens, cap.source) == (1404, 16, 16, "engine log")
    given = engine_capacity(LoadSpec(gpu_kv_tokens=5000, offload_kv_tokens=90000, chunk_tokens=64), log, 16)
    assert (given.gpu_tokens, given.offload_tokens, given.chunk_tokens, given.source) == (5000, 90000, 64, "matrix")
    assert engine_capacity(LoadSpec(), "", 16).source == "default"

"""A checkpoint moved from one replica's cache to another's (what the Ray replicas send through the object
store): the receiver's next turn restores it and answers exactly as without any cache; a package that
fails a check is refused and nothing is stored."""

import dataclasses

import pytest

from hyserve.engine import GenerationRequest
from hyserve.engine.sampling import SamplingParams
from hyserve.scale.transfer import Transfers, worth_fetching

from ..conftest import wait_idle

SALT = "tenant:"


def turn(service, messages, salt=SALT):
    prompt = service.runtime.render_chat(messages, True, salt)
    fin = service.engine.generate(
        GenerationRequest(
            prompt=prompt, max_tokens=10, messages=messages, sampling=SamplingParams(temperature=0.0), cache_salt=salt
        )
    )
    wait_idle(service)
    return prompt, fin


@pytest.fixture(scope="module")
def moved(make_service):
    holder, receiver, reference = (
        make_service("qwen3_5"),
        make_service("qwen3_5"),
        make_service("qwen3_5", cache_enabled=False),
    )
    messages = [{"role": "system", "content": "You are terse. " * 10}, {"role": "user", "content": "Name a tree."}]
    _, fin = turn(holder, messages)
    messages += [{"role": "assistant", "content": fin.text}, {"role": "user", "content": "And a river?"}]
    prompt = holder.runtime.render_chat(messages, True, SALT)
    with holder.runtime.lock:
        depth = holder.cache.tree.lookup(prompt, len(prompt) - 1, False, SALT).length
    return holder, receiver, reference, messages, prompt, depth


def test_a_moved_checkpoint_serves_the_next_turn_exactly(moved):
    holder, receiver, reference, messages, prompt, depth = moved
    package = Transfers(holder).export(SALT, prompt)
    assert package is not None and package.num_tokens == depth
    assert Transfers(receiver).take(package, SALT, prompt[:depth]) == "stored"
    assert receiver.cache.telemetry.events()[-1]["event"] == "loaded"
    got_prompt, got = turn(receiver, messages)
    _, want = turn(reference, messages)
    assert got_prompt == prompt and got.cached_tokens == depth > 0
    assert got.token_ids == want.token_ids


def test_a_package_that_fails_a_check_is_refused(moved):
    holder, receiver, _, _, prompt, depth = moved
    transfers = Transfers(receiver)
    package = Transfers(holder).export(SALT, prompt)
    key = next(iter(package.tensors))
    tampered = dataclasses.replace(package, tensors={**package.tensors, key: package.tensors[key] + 1})
    cases = [
        (tampered, SALT, prompt[:depth], "checksum_mismatch"),
        (dataclasses.replace(package, fingerprint="another model"), SALT, prompt[:depth], "fingerprint_mismatch"),
        (package, "other:", prompt[:depth], "salt_mismatch"),
        (package, SALT, prompt[1 : depth + 1], "hash_mismatch"),
    ]
    before = receiver.cache.tree.entries
    for pkg, salt, tokens, why in cases:
        assert transfers.take(pkg, salt, tokens) == why
        assert receiver.cache.telemetry.events()[-1]["reason"] == f"replica_{why}"
    assert receiver.cache.tree.entries == before


def test_export_sends_the_deepest_checkpoint_unless_prefilling_is_cheaper(moved):
    holder, _, _, _, prompt, depth = moved
    transfers = Transfers(holder)
    assert transfers.export(SALT, prompt).num_tokens == depth  # the deepest exact prefix of what is asked
    assert transfers.export(SALT, prompt, deeper_than=depth) is None  # the asker holds as much already
    assert transfers.export("other:", prompt) is None  # another tenant's
    size = transfers.export(SALT, prompt).nbytes
    assert transfers.export(SALT, prompt, max_bytes=lambda saved: size - 1) is None
    assert transfers.export(SALT, prompt, 10, max_bytes=lambda saved: size if saved == depth - 10 else 0) is not None
    assert worth_fetching(prefill_tokens_per_s=2000, transfer_bytes_per_s=1e9)(1000) == 500_000_000

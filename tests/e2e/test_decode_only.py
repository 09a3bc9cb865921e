"""Without a prefill worker the decode worker prefills by itself (chunked), matching the reference."""

from __future__ import annotations

import pytest
from support import prompt_of

from tandem.client import connect
from tandem.shared.model.reference import reference_generate


@pytest.fixture(scope="module")
def solo(start_system):
    return start_system(prefill=0, decode=1, decode_args=["--max-num-batched-tokens", "32"])


@pytest.mark.parametrize("length", [1, 16, 33, 64, 65])
async def test_decode_worker_prefills_alone(solo, tiny, length):
    prompt = prompt_of(length)
    async with connect(solo.url) as client:
        result = await client.complete(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
    expected, _ = reference_generate(tiny.model, tiny.tokenizer.encode(prompt), 8)
    assert result.token_ids == list(expected), f"local prefill of {length} tokens diverged from the reference"

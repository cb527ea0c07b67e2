"""Greedy through the `openai` client (streaming and not, and a cached second turn) == transformers
`generate()`, for every hybrid family of issue 21."""

import pytest

from ..conftest import HYBRIDS
from . import test_openai_api


@pytest.mark.parametrize("arch", HYBRIDS)
def test_chat_greedy_equals_transformers_generate(servers, arch):
    test_openai_api.test_chat_greedy_equals_transformers_generate(servers, arch)

"""bench/vocab_chunk_ab.py runs one batch's update in every way asked for, from one state,
each way with its own chunk and block sizes, and puts postrl's defaults back."""

import pytest

from postrl.models import logprobs, vocab
from tests.bench_scripts import load_bench_script


def test_every_way_runs_with_its_sizes_and_the_defaults_are_restored(monkeypatch, capsys,
                                                                    tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSTRL_NATIVE_KERNELS", "0")  # blocks: PyTorch's vocabulary pass
    seen = []
    real = vocab._blocks
    monkeypatch.setattr(vocab, "_blocks", lambda z: seen.append(
        (logprobs.HEAD_CHUNK_TOKENS, vocab.BLOCK_ELEMENTS)) or real(z))
    defaults = logprobs.HEAD_CHUNK_TOKENS, vocab.BLOCK_ELEMENTS
    script = load_bench_script("vocab_chunk_ab")
    assert script.parse_ways("64:0,16:4096") == [(64, 0), (16, 4096)]
    script.main(["--regime", "short", "--reps", "1", "--model", "tiny",
                 "--ways", "64:0,16:4096"])
    printed = capsys.readouterr().out
    assert "64 tokens, blocks of      all: update" in printed
    assert "16 tokens, blocks of     4096: update" in printed
    assert {(64, 2**62), (16, 4096)} <= set(seen)  # "0": one block, whatever the chunk
    assert (logprobs.HEAD_CHUNK_TOKENS, vocab.BLOCK_ELEMENTS) == defaults


@pytest.mark.parametrize("ways", ["2048:x", "0:0", "512:-1", "512,abc"])
def test_a_way_that_is_not_tokens_and_elements_is_named(ways, capsys):
    with pytest.raises(SystemExit):
        load_bench_script("vocab_chunk_ab").main(["--ways", ways])
    assert "argument --ways" in capsys.readouterr().err

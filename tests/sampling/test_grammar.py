"""Structured outputs: StructuredOutputsParams' checks and bounds, the grammar compiler (errors with xgrammar's
reason and no engine paths, its cache), the bitmask op against a dense reference, the draft-tree check against a
matcher advanced token by token."""

import numpy as np
import pytest
import torch

from tests.tokenizers_local import build_tokenizer
from treedec import SamplingParams, StructuredOutputsParams
from treedec.models.text import load_tokenizer
from treedec.sampling.structured import MAX_CHOICES, MAX_REGEX_CHARS, MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH

xgr = pytest.importorskip("xgrammar")
from treedec.sampling.grammar import (BitmaskRows, DraftGrammar, GrammarCompiler, GrammarError,  # noqa: E402
                                      apply_bitmask, bitmask_width)

DEEP = {"type": "object"}
for _ in range(MAX_SCHEMA_DEPTH):
    DEEP = {"type": "object", "properties": {"x": DEEP}}
VOCAB = 512   # (the tiny model's: the tokenizer has 400 ids, the rest are never allowed)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, (2,))


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"regex": ""}, "non-empty string"),
    ({"regex": "a" * (MAX_REGEX_CHARS + 1)}, f"at most {MAX_REGEX_CHARS}"),
    ({"choice": []}, "1 to"),
    ({"choice": "ab"}, "list of strings"),
    ({"choice": ["x"] * (MAX_CHOICES + 1)}, "1 to"),
    ({"choice": ["ok", ""]}, "strings of 1 to"),
    ({"json": "{nope"}, "not valid JSON"),
    ({"json": [1, 2]}, "JSON schema"),
    ({"json": {"description": "x" * MAX_SCHEMA_CHARS}}, f"at most {MAX_SCHEMA_CHARS}"),
    ({"json": DEEP}, f"more than {MAX_SCHEMA_DEPTH} levels"),
    ({"json_object": "yes"}, "true or false"),
    ({"grammar": "root ::= \"a\"", "disable_any_whitespace": 1}, "true or false"),
])
def test_params_are_checked_and_bounded(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_params_in_sampling_params_and_as_a_mapping():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=("a", "b")) and p.processes_logits
    assert StructuredOutputsParams(json='{"type": "integer"}').key == ("json", '{"type":"integer"}', False)
    with pytest.raises(ValueError, match="no field 'pattern'"):
        SamplingParams(structured_outputs={"pattern": "a"})
    # the schema's key order is the output's properties' order: kept
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).json == '{"b":1,"a":2}'


@pytest.mark.parametrize("so, reason", [
    (StructuredOutputsParams(json={"type": "nonsense"}), "Unsupported type"),
    (StructuredOutputsParams(json={"$ref": "#/missing"}), "missing"),
    (StructuredOutputsParams(regex="(ab"), "parenthesis"),
    (StructuredOutputsParams(grammar="root ::= other"), "not defined"),
])
def test_bad_constraints_raise_grammar_error_with_the_reason_and_no_path(compiler, so, reason):
    with pytest.raises(GrammarError) as caught:
        compiler.compile(so)
    message = str(caught.value)
    assert message.startswith(f"structured_outputs.{so.kind}: cannot be compiled:") and reason in message
    assert ".cc:" not in message and "/project/" not in message


def test_compiled_grammars_are_cached_by_key(compiler):
    a = compiler.compile(StructuredOutputsParams(regex="[ab]+c"))
    hits = compiler.hits
    assert compiler.compile(StructuredOutputsParams(regex="[ab]+c")) is a and compiler.hits == hits + 1
    assert compiler.compile(StructuredOutputsParams(regex="[ab]+d")) is not a


def test_apply_bitmask_equals_a_dense_mask():
    rng = np.random.default_rng(0)
    v = 77
    allowed = rng.random((5, v)) < 0.3
    words = np.zeros((5, bitmask_width(v)), dtype=np.uint32)
    for i, j in zip(*np.nonzero(allowed)):
        words[i, j // 32] |= np.uint32(1) << np.uint32(j % 32)
    logits = torch.randn(5, v)
    got = apply_bitmask(logits.clone(), torch.from_numpy(words.view(np.int32)))
    want = logits.masked_fill(~torch.from_numpy(allowed), float("-inf"))
    assert torch.equal(got, want)


def test_batched_fill_equals_each_matcher_alone(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}}))
    matchers = [grammar.matcher((2,)) for _ in range(3)]
    for m, text in zip(matchers, ["", "[1", "[12, "]):
        for t in tokenizer.encode(text, add_special_tokens=False):
            assert m.accept_token(t)
    rows = BitmaskRows(VOCAB, torch.device("cpu")).fill(matchers)
    for i, m in enumerate(matchers):
        alone = xgr.allocate_token_bitmask(1, VOCAB)
        m.fill_next_token_bitmask(alone)
        assert torch.equal(rows[i], alone[0])
    assert rows.shape == (3, bitmask_width(VOCAB))


def test_draft_tree_check_equals_a_matcher_along_each_path(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutputsParams(regex="(ab|ac)[0-9]x"))
    enc = {c: tokenizer.encode(c, add_special_tokens=False)[0] for c in "abcx15"}
    root = enc["a"]
    # root a; children b, x, c; b's children 1, a; 1's child x; c's child 5
    parents = [-1, 0, 0, 0, 1, 1, 4, 3]
    tokens = [root, enc["b"], enc["x"], enc["c"], enc["1"], enc["a"], enc["x"], enc["5"]]
    state = DraftGrammar(grammar, torch.device("cpu"), (2,))
    assert state.matcher.accept_token(root)
    kept, masks = state.prune(parents, tokens)
    assert kept.tolist() == [0, 1, 3, 4, 6, 7]   # x after a and a after ab are not the grammar's
    for row, node in enumerate(kept.tolist()):   # each kept node's mask: a matcher advanced along its path
        path, i = [], node
        while i > 0:
            path.append(tokens[i])
            i = parents[i]
        m = grammar.matcher((2,))
        for t in [root] + path[::-1]:
            assert m.accept_token(t)
        alone = xgr.allocate_token_bitmask(1, VOCAB)
        m.fill_next_token_bitmask(alone)
        assert torch.equal(masks[row], alone[0]), node
    assert state.matcher.accept_token(enc["b"])   # (the matcher was left at the root)

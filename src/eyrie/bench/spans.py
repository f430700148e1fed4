"""Acceptance inside the target's thinking, tool-call and answer spans, measured apart.

Each generated token is labelled by the span it sits in: thinking between a reasoning pair of markers
(<think>...</think>, or the template's own), tool call between a tool-call pair (<tool_call>...</tool_call>,
or the template's own), answer elsewhere; a marker belongs to the span it opens or closes. A speculative
round counts for the span of its first new token, and the span's mean is the tokens its rounds emitted
(accepted drafts plus the bonus) over its rounds: the same measure as mean_acceptance_length.
"""

from __future__ import annotations

from eyrie.target.markers import known_text, pick_markers

SPANS = ("thinking", "tool_call", "answer")


def _regions(text: str, markers: dict[str, tuple[str, str]]) -> list[tuple[int, int, str]]:
    """(start, end, span) of every marked region of text in order; an unclosed region runs to the end."""
    regions, position = [], 0
    while True:
        opens = [(text.find(open_, position), span) for span, (open_, _) in markers.items()]
        opens = [(at, span) for at, span in opens if at >= 0]
        if not opens:
            return regions
        start, span = min(opens)
        close = markers[span][1]
        found = text.find(close, start + len(markers[span][0]))
        end = len(text) if found < 0 else found + len(close)
        regions.append((start, end, span))
        position = end


def label_tokens(pieces: list[str], markers: dict[str, tuple[str, str]], prefix: str = "") -> list[str]:
    """The span of each generated token (its decoded piece): the span its first character falls in. `prefix` is the
    rendered prompt, whose open marker a template's generation prompt may leave unclosed (generation starts in thinking)."""
    text = prefix + "".join(pieces)
    regions = _regions(text, markers)
    labels, offset, index = [], len(prefix), 0
    for piece in pieces:
        while index < len(regions) and regions[index][1] <= offset:
            index += 1
        inside = index < len(regions) and regions[index][0] <= offset < regions[index][1]
        labels.append(regions[index][2] if inside else "answer")
        offset += len(piece)
    return labels


def round_spans(labels: list[str], acceptance_lengths: list[int]) -> list[str]:
    """The span of each round: the label of its first new token (tokens[0] is the prefill's, before any round)."""
    if sum(acceptance_lengths) != len(labels) - 1:
        raise ValueError(f"rounds emitted {sum(acceptance_lengths)} tokens, but {len(labels) - 1} follow the prefill's token")
    spans, first = [], 1
    for length in acceptance_lengths:
        spans.append(labels[first])
        first += length
    return spans


def acceptance_by_span(decodes: list[tuple[list[str], list[int]]]) -> dict[str, dict]:
    """{span: {rounds, mean}} over decodes, each (token labels, acceptance lengths); mean None where a span has no round."""
    rounds = dict.fromkeys(SPANS, 0)
    emitted = dict.fromkeys(SPANS, 0)
    for labels, lengths in decodes:
        for span, length in zip(round_spans(labels, lengths), lengths):
            rounds[span] += 1
            emitted[span] += length
    return {span: {"rounds": rounds[span], "mean": emitted[span] / rounds[span] if rounds[span] else None} for span in SPANS}


def measure_spans(tokenizer, decodes: list[tuple[list[int], list[int], list[int]]]) -> dict[str, dict]:
    """acceptance_by_span over decodes, each (prompt ids, speculative tokens, acceptance lengths), with the
    tokenizer's markers (eyrie.target.markers.pick_markers) and each token decoded on its own."""
    markers = pick_markers(known_text(tokenizer))
    labelled = []
    for prompt_ids, tokens, lengths in decodes:
        pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
        prefix = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        labelled.append((label_tokens(pieces, markers, prefix), lengths))
    return {**acceptance_by_span(labelled), "markers": {span: list(pair) for span, pair in markers.items()}}

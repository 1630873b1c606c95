"""
Text cut as it arrives: a stream of text (a language model's tokens, a transcript) given
out a sentence, or a clause, at a time, each as soon as it is certain to be one.

The boundaries are the SDK's long-text splitter's (L{split_text},
protocol.md section 8), read from the same rules rather than copied: abbreviations,
initials, decimals and "Wait... what?" stay whole, marks that need no space (CJK,
Devanagari, Arabic) end a sentence at once, and closing quotes and brackets stay with what
they close.  A Latin-style terminator's cut depends on the word after it (a lower-case
word, or the rest of "Dr. Smith", continues the sentence), so a sentence that ends in one
is given out once whitespace and the first letter of the next word have arrived.  Text
that never reaches such a point waits for L{TextCutter.flush}.

Whatever chunks the text arrives in, the pieces are the ones L{cut_text} gives for the
whole of it.
"""

from __future__ import annotations

from ._split import Piece, _clauses, _sentence_spans, _undecided_from, split_pieces, split_text

__all__ = ["GRANULARITIES", "Piece", "TextCutter", "cut_text", "split_pieces", "split_text"]

#: What a piece is: the whole text until a flush, a sentence, or a clause of one.
GRANULARITIES = ("none", "sentence", "clause")


def cut_text(text: str, granularity: str = "sentence") -> list[str]:
    """
    The pieces of C{text} at C{granularity}, stripped and in order: what a L{TextCutter}
    gives for it, fed in any chunks and then flushed.

    @raise ValueError: for a granularity not in L{GRANULARITIES}.
    """
    cutter = TextCutter(granularity)
    return cutter.feed(text) + cutter.flush()


class TextCutter:
    """
    Text fed in any chunks, given back as pieces once each is settled.

    Not thread-safe; each piece is given out once, in order.

    @ivar granularity: one of L{GRANULARITIES}.
    """

    def __init__(self, granularity: str = "sentence") -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, not {granularity!r}")
        self.granularity = granularity
        # The text not yet given out, from the start of the first sentence not given
        # whole (a clause cut can fall inside a word, and the sentence rules read whole
        # words, so the sentence is kept from its start), and how much of it the
        # clauses given out already cover.
        self._text = ""
        self._given = 0

    @property
    def held(self) -> int:
        """
        How many characters are held that no piece has yet given out.
        """
        return len(self._text) - self._given

    def feed(self, text: str) -> list[str]:
        """
        Take C{text}, the next chunk of the stream, and give back every piece now settled.
        """
        self._text += text
        if self.granularity == "none" or not text:
            return []
        return self._cut(final=False)

    def flush(self) -> list[str]:
        """
        The stream has ended (for now): every piece still held, as if the text had ended
        here.  The cutter is then empty and may be fed again.
        """
        if self.granularity == "none":
            whole = self._text.strip()
            pieces = [whole] if whole else []
        else:
            pieces = self._cut(final=True)
        self._text, self._given = "", 0
        return pieces

    def _cut(self, final: bool) -> list[str]:
        text = self._text
        horizon = len(text) if final else _undecided_from(text)
        given = self._given
        keep = 0
        pieces: list[str] = []
        spans = list(_sentence_spans(text))
        for index, (start, end, marked) in enumerate(spans):
            following = spans[index + 1][0] if index + 1 < len(spans) else None
            settled = final or (following is not None and (marked or following <= horizon))
            if self.granularity == "clause":
                clauses = list(_clauses(text, start, end))
                for at, (c_start, c_end) in enumerate(clauses):
                    if c_end <= given:
                        continue
                    if not settled and not _clause_settled(text, clauses, at, horizon):
                        break
                    pieces.append(text[c_start:c_end])
                    given = c_end
            elif settled:
                pieces.append(text[start:end])
            if not settled:
                keep = start
                break
            keep = len(text) if following is None else following
        self._text = text[keep:]
        self._given = max(given - keep, 0)
        return pieces


def _clause_settled(text: str, clauses: list[tuple[int, int]], at: int, horizon: int) -> bool:
    """
    Whether the cut after clause C{at} of a sentence still open is settled: the next
    clause has begun, and either its first word has (a comma's cut waits, as a
    terminator's does, on whether closing quotes follow it) or the cut falls inside a
    word (a dash or a CJK comma), where the marks it took are already followed by
    something else.
    """
    if at + 1 >= len(clauses):
        return False
    end = clauses[at][1]
    return clauses[at + 1][0] <= horizon or not text[end].isspace()

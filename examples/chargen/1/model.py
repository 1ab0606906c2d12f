"""chargen: a tiny character-level text generator, served as a decoupled model.

A character bigram model built with torch when the model loads: the counts of which
character follows which in the text below, smoothed, as a [V, V] table of
log-probabilities. Each step looks up the next-character distribution of every request
in the batch at once, then draws one character per request from a generator seeded by
its prompt, so the same request always gets the same text.

Each request sends ``text_input`` (the prompt, BYTES [1]) and ``max_tokens`` (INT32
[1]) and receives ``max_tokens`` responses of one character each (``text_output``),
the last one final. A request asking for 0 characters gets one empty final response.
"""

import zlib

import numpy as np
import torch

CORPUS = (
    "the model answers one request with many responses. each response leaves the "
    "worker as soon as it is produced, travels through the broker in order, and "
    "reaches the client before the next one is made. a client that closes its stream "
    "stops the generation at the next step, and the worker takes the next batch. "
    "streaming is what text generation, progressive detection and chunked speech "
    "synthesis need: the first words arrive while the rest are still being written. "
)


class Model:
    def load(self, version_dir, device):
        self.device = device
        self.chars = sorted(set(CORPUS))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.index[c] for c in CORPUS])
        counts = torch.full((len(self.chars), len(self.chars)), 0.01)   # smoothing
        counts.index_put_((ids[:-1], ids[1:]), torch.ones(len(ids) - 1), accumulate=True)
        self.log_probs = (counts / counts.sum(dim=1, keepdim=True)).log().to(device)

    def _last_char(self, prompt: bytes) -> int:
        text = prompt.decode("utf-8", "replace").lower()
        known = [self.index[c] for c in text if c in self.index]
        return known[-1] if known else self.index[" "]

    def predict(self, inputs, rows):
        """Yields {request index: ({"text_output": one character}, final)} per step."""
        prompts = [inputs["text_input"][r][0][0] for r in rows]
        wanted = [int(inputs["max_tokens"][r][0][0]) for r in rows]
        gens = [torch.Generator().manual_seed(zlib.crc32(p)) for p in prompts]
        last = torch.tensor([self._last_char(p) for p in prompts])
        done = {i: 0 for i in range(len(rows))}
        empty = {i: (None, True) for i, n in enumerate(wanted) if n <= 0}
        if empty:
            yield empty
        running = [i for i, n in enumerate(wanted) if n > 0]
        while running:
            probs = self.log_probs[last].exp().cpu()
            step = {}
            for i in running:
                nxt = int(torch.multinomial(probs[i], 1, generator=gens[i]))
                last[i] = nxt
                done[i] += 1
                out = np.array([[self.chars[nxt].encode()]], dtype=object)
                step[i] = ({"text_output": out}, done[i] == wanted[i])
            yield step
            running = [i for i in running if done[i] < wanted[i]]

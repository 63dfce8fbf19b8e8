"""The sleep table's Llama-shaped trainer (sleep_bench.py, tms_bench.py): the model, sized by the
SLEEP_* knobs (sleep_common.py), and its training steps on random tokens with the math attention
kernel, so that a run's losses are bit-for-bit repeatable."""
import torch

from sleep_common import BATCH, FFN, HEADS, KV_HEADS, LAYERS, SEQ, VOCAB, WIDTH


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = WIDTH // HEADS
        self.n1, self.n2 = torch.nn.RMSNorm(WIDTH), torch.nn.RMSNorm(WIDTH)
        self.q = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.kv = torch.nn.Linear(WIDTH, 2 * KV_HEADS * self.hd, bias=False)
        self.o = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.up = torch.nn.Linear(WIDTH, 2 * FFN, bias=False)
        self.down = torch.nn.Linear(FFN, WIDTH, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, HEADS, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, KV_HEADS, self.hd).unbind(2)
        rep = HEADS // KV_HEADS

        def widen(z):  # GQA by expand + reshape: its backward is a plain sum, no index_add
            z = z.transpose(1, 2)[:, :, None].expand(b, KV_HEADS, rep, t, self.hd)
            return z.reshape(b, HEADS, t, self.hd)

        a = torch.nn.functional.scaled_dot_product_attention(q, widen(k), widen(v), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        g, u = self.up(self.n2(x)).chunk(2, -1)
        return x + self.down(torch.nn.functional.silu(g) * u)


class Llama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.RMSNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def steps(model, opt, n, gen):
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    losses = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=next(model.parameters()).device, generator=gen)
        with sdpa_kernel(SDPBackend.MATH):
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses

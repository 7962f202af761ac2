"""A fingerprint of this host's float bits: seeded computations of each kernel family an experiment uses, each
digested, on the paths runners/numerics.py pins. ``python -m runners.fingerprint`` on two hosts, compared line by
line, says which family gives other bits there before a whole experiment is run to find out."""

from __future__ import annotations

from runners.numerics import describe


def fingerprint(threads: int = 1) -> dict[str, str]:
    """Name -> digest of each seeded computation (random fills, ATen's reductions and vectorised maths, MKL's matrix
    products, a backward pass, an AdamW step) on this process's paths, after what computes them (``cpu``, torch,
    threads). ``threads`` is the intra-op thread count: one, as every rank runs (it changes the bits too)."""
    import torch

    from ledger.digests import raw_digest

    torch.set_num_threads(threads)

    def digest(t: torch.Tensor) -> str:
        return raw_digest(t.detach().contiguous().numpy().tobytes())

    gen = torch.Generator().manual_seed(20261207)
    x = torch.randn(257, 263, generator=gen)
    w = torch.randn(263, 131, generator=gen)
    out = {
        "cpu": describe(),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "randn (ATen normal fill)": digest(x),
        "rand (ATen uniform fill)": digest(torch.rand(4099, generator=gen)),
        "sum, mean, norm (ATen reductions)": digest(torch.stack([x.sum(), x.mean(), x.norm(), x.sum(1).sum()])),
        "exp, tanh, log1p (ATen vectorised maths)": digest(torch.cat([x.exp(), x.tanh(), x.abs().log1p()])),
        "softmax, layer_norm": digest(torch.cat([x.softmax(-1), torch.nn.functional.layer_norm(x, (263,))])),
        "matmul 257x263 @ 263x131 (MKL sgemm)": digest(x @ w),
        "matmul 64x64 @ 64x64": digest(x[:64, :64] @ w[:64, :64]),
        "bmm 8x32x48 @ 8x48x40": digest(torch.bmm(torch.randn(8, 32, 48, generator=gen),
                                                  torch.randn(8, 48, 40, generator=gen))),
    }
    layer = torch.nn.Linear(263, 131)
    with torch.no_grad():
        layer.weight.copy_(w.t())
        layer.bias.copy_(w[0])
    loss = torch.nn.functional.cross_entropy(layer(x), torch.arange(257) % 131)
    loss.backward()
    assert layer.weight.grad is not None
    out["linear + cross_entropy backward"] = digest(torch.cat([loss.reshape(1), layer.weight.grad.flatten()]))
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, foreach=False)
    opt.step()
    out["AdamW step"] = digest(torch.cat([p.flatten() for p in layer.parameters()]))
    return out


if __name__ == "__main__":
    for name, value in fingerprint().items():
        print(f"{name:44}  {value}")  # two spaces at least: names have single ones

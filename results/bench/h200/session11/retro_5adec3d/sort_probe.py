"""Ranking's top columns on the H200: composite int64 top-k (current) vs a stable descending float32 sort."""
import torch, time
torch.manual_seed(0)
for n, cols, top in ((40, 8320, 5418), (40, 8320, 2080)):
    s = torch.rand(n, cols, device="cuda")
    s[:, -100:] = float("-inf")
    def topk():
        tiebreak = cols - 1 - torch.arange(cols, device=s.device)
        key = s.view(torch.int32).to(torch.int64).mul_(1 << 32).add_(tiebreak)
        return key.topk(top, dim=-1, sorted=True).indices
    def sort():
        return torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :top]
    assert torch.equal(topk(), sort())
    for name, fn in (("topk", topk), ("sort", sort)):
        for _ in range(3): fn()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(50): fn()
        torch.cuda.synchronize(); print(n, cols, top, name, round((time.perf_counter() - t) / 50 * 1e6, 1), "us")

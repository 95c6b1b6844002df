"""The twin as a live server: one simulated SGLang replica on the wall clock behind
SGLang 0.5.23's HTTP interface (`servetwin emulate`; docs/emulator.md).

- `engine`: the replica driven from asyncio on the wall clock (`Engine`, `LiveFeed`).
- `protocol`: SGLang's request checks and error responses, the prompt-length rule.
- `metrics`: `/metrics` under SGLang's names and the users' (prometheus-client).
- `server`: the aiohttp routes (`Emulator`, `EmulatorThread`).
- `process`: `servetwin emulate` as a subprocess (`EmulatorProcess`; a fleet of them).
- `agreement`: bench_serving and servetwin's replay against an emulator vs simulate.
"""

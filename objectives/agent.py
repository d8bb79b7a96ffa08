"""Agentic reinforcement learning with tools (docs/rl.md, data.format=agent): GRPO's rollouts made
multi-turn as MiniMind's trainer/train_agent.py makes them, exact on any world size and across resumes.

Each completion r of prompt i is an episode of up to train.agent.max_turns turns. A turn: the model
generates (one sequence, KV-cached across its turns, up to train.grpo.max_new_tokens or its EOS), its
draws from a generator seeded by derive_seed(seed, STREAM, step, i, r, turn); the turn's text is parsed
for tool calls (train.agent.parser: MiniMind's `<tool_call>{json}</tool_call>`, or a user's); with none
the episode is over; else each call runs (objectives/tools.py) and the tool messages, rendered by the
chat template with the line's tools, are appended as ids (the template's text after the assistant's
EOS, through the next generation prompt) and the model continues. The loss mask covers the model's own
ids (with the EOS that ends each turn), never the prompt or a tool's result. An episode whose last turn
still called tools, or whose next tool message would leave no position of model.seq_len to generate in
(cut at that turn boundary), is unfinished. The reward (train.grpo.reward; minimind_agent is MiniMind's)
sees the last turn's text, every turn's text (`turns`), `unfinished`, the whole `transcript` (messages
with the tools' results) and the line's fields (gt, tools, ...). Advantages, losses and the resume state
are GRPO's (objectives/grpo.py); the state also holds each episode's counts (turns, calls, successful
calls, unfinished), so a resumed run logs the same figures.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from common.outcome import BadInput, Failed
from common.seeds import derive_seed
from model.generate import sample
from model.model import KVCache

from . import rewards as reward_fns
from . import tools as agent_tools
from .grpo import GRPO, NO_FSDP, RL_HEADLINE, RL_PINS, GRPOConfig, RolloutState, completions_check, prompts_plan
from .spec import ALL, MatrixValue, ObjectiveSpec, Refusal, register
from .worker import Late, Raised, Remote, described

log = logging.getLogger("minimind")
STREAM = 0x4147454E  # "AGEN": turn t of completion r of prompt i draws from derive_seed(seed, STREAM, step, i, r, t)
COUNTS = ("turns", "calls", "ok", "unfinished")
"""Each episode's counts, kept beside its rollout (the resume state) for the step's metrics."""


@dataclass
class AgentConfig:
    """train.agent: the tools of data.format=agent's multi-turn rollouts (train.objective=grpo)."""

    tools: str = ",".join(agent_tools.BUILTIN)
    """The tools the model may call, comma-separated: built-ins (MiniMind's six mock tools) or module:function
    (path/file.py:function), the tool's name its function's; each file pinned by its sha256."""
    max_turns: int = 3
    """Turns of the model per episode (MiniMind's 3); an episode still calling tools at its last turn is unfinished."""
    tool_timeout_s: float = 10.0
    """The longest one tool call may take: one that does not return by then fails the run naming it (exit 1)."""
    parser: str = "minimind"
    """How a turn's tool calls are read: minimind (`<tool_call>{"name", "arguments"}</tool_call>`) or module:function,
    text -> a list of {"name", "arguments"}; pinned like the tools."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"train.agent.max_turns must be >= 1, got {self.max_turns}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"train.agent.tool_timeout_s must be > 0 (seconds), got {self.tool_timeout_s}")
        if not [s for s in self.tools.split(",") if s.strip()]:
            raise ValueError("train.agent.tools: name at least one tool (built-ins: " + ", ".join(agent_tools.BUILTIN) + ")")

    def specs(self) -> list[str]:
        return [s.strip() for s in self.tools.split(",") if s.strip()]


class AgentRolloutState(RolloutState):
    """GRPO's rollout state with each episode's counts."""

    KEYS = (*RolloutState.KEYS, "counts")

    def _template(self) -> dict:
        return {**super()._template(), "counts": torch.zeros(self.grpo.global_completions, len(COUNTS))}


class Agent(GRPO):
    """GRPO over multi-turn episodes with tools (module docstring); the interface of objectives.NextToken."""

    def __init__(self, dataset, micro_batches: int, global_completions: int, cfg: GRPOConfig, agent: AgentConfig, seed: int, tok,
                 rt, model=None) -> None:
        from data.chat import template_of

        ours = cfg.reward in agent_tools.REWARDS
        super().__init__(dataset, micro_batches, global_completions, dataclasses.replace(cfg, reward="answer") if ours else cfg,
                         seed, tok, rt, model)
        self.cfg, self.agent = cfg, agent
        self.reward, record = reward_fns.load(cfg.reward, builtin={**reward_fns.BUILTIN, **agent_tools.REWARDS})
        self.toolbox = agent_tools.Toolbox(agent.specs(), agent.tool_timeout_s)
        self.parse, parser = reward_fns.load(agent.parser, "train.agent.parser", {"minimind": agent_tools.parse_tool_calls})
        self.reward_record = {**record, "tools": self.toolbox.records, "parser": parser, "max_turns": agent.max_turns}
        self.template = template_of(tok)
        self.counts: list[tuple[int, torch.Tensor]] = []

    # ---------------------------------------------------------------- set-up
    def start(self, cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes]) -> None:
        """GRPO's (the reward and reference pinned), the tools and the parser pinned (a changed file refused, naming both
        hashes), and every tool a line offers implemented."""
        if resumed and meta.reward:
            names, now = [r["name"] for r in meta.reward.get("tools", [])], [r["name"] for r in self.toolbox.records]
            if names != now:
                raise BadInput(f"train.agent.tools: {','.join(now)}, but the steps of {resumed.path} offered {','.join(names) or 'none'}: "
                               f"another set of tools is another environment (resume with the same)")
            if meta.reward.get("max_turns", self.agent.max_turns) != self.agent.max_turns and rt.is_main:
                log.warning("train.agent.max_turns=%d, the checkpoint's %s: the rollouts from here on differ from the uninterrupted "
                            "run's", self.agent.max_turns, meta.reward.get("max_turns"))
            was = {r["name"]: r for r in meta.reward.get("tools", [])}
            was["parser"] = meta.reward.get("parser") or {}
            for key, r in [*((r["name"], r) for r in self.toolbox.records), ("parser", self.reward_record["parser"])]:
                old = was.get(key)
                if old is not None and (old.get("spec"), old.get("sha256")) != (r.get("spec"), r.get("sha256")):
                    setting = "train.agent.parser" if key == "parser" else "train.agent.tools"
                    raise BadInput(f"{setting}: {r.get('file') or r['spec']} has sha256 {r.get('sha256')}, but the steps of "
                                   f"{resumed.path} called one of sha256 {old.get('sha256')} ({old.get('spec')})")
        offered: dict[str, str] = {}
        for k in range(len(self.dataset)):
            fields = self.dataset.fields(k)
            for tool in fields["tools"]:
                offered.setdefault(tool["function"]["name"], fields["line"])
        for name, where in offered.items():
            self.toolbox.check([{"function": {"name": name}}], where)
        super().start(cfg, rt, meta, resumed, agree, tok_files)

    # ---------------------------------------------------------------- an episode
    def observation(self, messages: list[dict], results: int, tools, ended: bool) -> list[int]:
        """The ids after the assistant's last turn: its EOS when the turn did not end with one, the template's text
        after that EOS, the `results` tool messages and the next generation prompt."""
        eos_text = self.template.specials["eos_token"]
        before = self.template.render(messages[:-results], tools)
        after = self.template.render(messages, tools, add_generation_prompt=True)
        if not after.startswith(before) or eos_text not in before:
            raise Failed(f"the chat template of {self.template.where} does not render an assistant turn followed by tool "
                         f"messages as the turn's text then theirs: a tool's result cannot be appended to a rollout")
        tail = before[before.rindex(eos_text) + len(eos_text):]
        return self.tok.encode_rendered(("" if ended else eos_text) + tail + after[len(before):])

    @torch.inference_mode()
    def episode(self, model, prompt: list[int], fields: dict, index: int, r: int, seq_len: int) -> dict:
        """Completion r of prompt `index`: its ids, which targets are the model's, its turns' texts, its transcript and counts."""
        cfg, eos, device = self.cfg, self.tok.eos, model.tok_embeddings.weight.device
        ids, mine = list(prompt), []
        messages, tools = [dict(m) for m in fields["messages"]], fields["tools"]
        cache, pending = KVCache(model, 1, seq_len), list(prompt)
        turns, calls, ok, unfinished = [], 0, 0, False
        for turn in range(self.agent.max_turns):
            gen = torch.Generator().manual_seed(derive_seed(self.seed, STREAM, self.step, index, r, turn))
            new, ended = [], False
            for _ in range(min(cfg.max_new_tokens, seq_len - len(ids))):
                logits, _ = model(torch.tensor([pending], dtype=torch.long, device=device), cache=cache)
                nxt = sample(logits[0, -1].float(), [], cfg.temperature, 0, cfg.top_p, 1.0, gen)
                new.append(nxt)
                pending = [nxt]
                if nxt == eos:
                    ended = True
                    break
            mine.extend(range(len(ids), len(ids) + len(new)))
            ids.extend(new)
            text = self.tok.decode([t for t in new if t != eos])
            turns.append(text)
            messages.append({"role": "assistant", "content": text})
            parsed = self._parse(text)
            if not isinstance(parsed, list):
                raise Failed(f"train.agent.parser={self.agent.parser} returned {type(parsed).__name__}: expected a list of calls")
            if not parsed:
                break
            results = [self.toolbox.run(c) for c in parsed]
            calls, ok = calls + len(results), ok + sum(s for _, s in results)
            messages.extend({"role": "tool", "content": text} for text, _ in results)
            if turn == self.agent.max_turns - 1:
                unfinished = True  # still calling tools at its last turn (MiniMind's rule)
                break
            seen = self.observation(messages, len(results), tools, ended)
            if len(ids) + len(seen) >= seq_len:  # no position left to answer in: cut at this turn boundary
                unfinished = True
                break
            ids.extend(seen)
            pending = pending + seen
        return {"ids": ids, "mine": mine, "turns": turns, "transcript": messages, "unfinished": unfinished, "truncated": not ended,
                "counts": [len(turns), calls, ok, int(unfinished)]}

    def _parse(self, text: str):
        """The turn's calls by train.agent.parser: a user's runs in the worker process, bounded by train.agent.tool_timeout_s."""
        if not isinstance(self.parse, Remote):
            return self.parse(text)
        try:
            return self.parse.call((text,), {}, self.agent.tool_timeout_s)
        except Late:
            raise Failed(f"train.agent.parser={self.agent.parser} did not return within train.agent.tool_timeout_s="
                         f"{self.agent.tool_timeout_s:g} s") from None
        except Raised as e:
            raise Failed(f"train.agent.parser={self.agent.parser} raised: {described(e)}") from None

    def group(self, model, prompt: list[int], fields: dict, index: int, seq_len: int) -> list[dict]:
        """GRPO's hook: the group's completions are episodes, one at a time; the reward scores the last turn's text
        and sees every turn's, `unfinished` and the transcript; an episode whose last turn ended without an EOS is
        truncated (train.grpo.mask_truncated)."""
        out = []
        for r in range(self.cfg.generations):
            ep = self.episode(model, prompt, fields, index, r, seq_len)
            seen = {**fields, "turns": ep["turns"], "unfinished": ep["unfinished"], "transcript": ep["transcript"]}
            out.append({"ids": ep["ids"], "mine": ep["mine"], "text": ep["turns"][-1], "seen": seen, "truncated": ep["truncated"],
                        "extra": ep["counts"]})
        return out

    def kept(self, extras: list) -> dict[str, torch.Tensor]:
        """Each episode's counts, beside the rollout (the resume state) for the step's metrics."""
        return {"counts": torch.tensor(extras, dtype=torch.float32)}

    # ---------------------------------------------------------------- a step
    def begin_step(self, indices: list[int], step: int = 0) -> None:
        super().begin_step(indices, step)
        self.counts = []

    def loss(self, net, batch, device, i: int = 0) -> torch.Tensor:
        out = super().loss(net, batch, device, i)
        self.counts.append((i, self.buffer[i]["counts"].double().sum(0)))
        return out

    def step_metrics(self, rt) -> dict:
        """GRPO's figures and the episodes': turns and tool calls per rollout, the calls' success rate, the unfinished share."""
        out = super().step_metrics(rt)
        rows = sorted((i, row.tolist()) for part in rt.all_gather(self.counts) for i, row in part)
        t = dict(zip(COUNTS, (sum(col) for col in zip(*(row for _, row in rows)))))
        n = self.global_completions
        return {**out, "agent/turns": t["turns"] / n, "agent/tool_calls": t["calls"] / n,
                "agent/tool_success": t["ok"] / max(t["calls"], 1.0), "agent/unfinished": t["unfinished"] / n}

    def states(self) -> dict:
        return {"rollout": AgentRolloutState(self, self.rt)} if self.cfg.updates_per_rollout > 1 else {}


register(ObjectiveSpec(
    name="agent", objective="grpo", order=50, summary="GRPO over multi-turn episodes with tools", docs="docs/rl.md",
    formats=("agent",), classes=(Agent,), sections={"agent": AgentConfig}, reads={"grpo": ALL, "agent": ALL},
    build=lambda c: Agent(c.dataset, c.micro_batches, c.cfg.train.global_batch, c.cfg.train.grpo, c.cfg.train.agent, c.cfg.seed, c.tok,
                          c.rt, c.model),
    plan=prompts_plan, supports=frozenset({"lora"}), why={"fsdp": NO_FSDP}, check=completions_check,
    refusals=(Refusal({"train.grpo.reward": ("answer", "answer_partial"), "data.format": "agent"},
                      "it reads a line's \"answer\" field, which agent lines do not have (their ground truth is gt)",
                      "use minimind_agent (MiniMind's agent reward) or a module:function"),),
    pins=(*RL_PINS, "the tools' and the parser's sha256 and max_turns (the manifest's reward)"), headline=RL_HEADLINE,
    matrix=(MatrixValue("agent", "agent"),)))

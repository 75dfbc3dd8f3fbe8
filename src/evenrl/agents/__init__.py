"""Agents (rollout.agent): a user's async function, or an environment library's own agent loop, drives the policy
through an OpenAI-compatible endpoint, and its calls are trained token for token (docs/agents.md).

How an agent is trained, module by module, in the order a rollout runs them:
- `rollout`: `Agents`, the trajectory loop the trainer runs for rollout.agent: a token per trajectory, the agents
  started in the contained workers, their requests served in batches on the engine, trajectories assembled.
- `job`: the agent function in a worker (`AgentRunner`: many agents on one event loop, each timed, each reaching
  only the endpoint) and `agent_problem`, the spec checked without importing user code (`evenrl plan`).
- `openenv_adapter`, `verifiers_adapter`: rollout.agent "openenv:..." and "verifiers:...", those libraries' own
  episodes run against the endpoint.
- `server`: the endpoint (FastAPI on a Unix socket, on a thread) that only queues requests for the rollout.
- `openai_api`, `openai_responses`: the chat, completions and Responses formats in and out.
- `prompts`: a request as prompt ids spliced onto the trajectory's earlier calls (sampled ids never re-tokenised)
  and the call's random key.
- `calls`: the recorded calls assembled into samples by token prefix.
- `replay`: rollout.partial's transcript of a trajectory's calls, replayed each step up to the call cut by the
  step's budget, which samples on.

Nothing is imported here: `evenrl plan` reads `job` without torch.
"""

"""RL post-training on our own serving engine (`python -m train.rl`, docs/rl.md): prompts and rewards
(`prompts`), built-in verifiable tasks and rewards (`tasks`), rollouts by the engine with weight sync (`rollout`),
group-relative advantages and the policy losses (`losses`), the jitted policy step (`step`), the command
(`command`)."""

"""rollout-backends: one protocol for RL rollouts and weight updates over SGLang and Dynamo."""

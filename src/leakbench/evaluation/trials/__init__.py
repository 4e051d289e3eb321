"""One trial: its spec and result, the trial kinds (attack, utility, bound), the plug-ins it uses, and the plan
that turns a sweep spec into trials."""

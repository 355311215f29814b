"""everstep trainer service: IcePop/TIS policy loss, the policy trainer, weight push, gRPC server.

The package root imports nothing heavy; import the modules you need
(`everstep_trainer.losses`, `everstep_trainer.policy_trainer`, `everstep_trainer.hf_model`, ...).
"""

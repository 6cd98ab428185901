"""Mirror of ``nanovllm/engine/llm_engine.py``: spawned workers for ranks 1.., rank 0 in this process.

Prompts are token-id lists (upstream also accepts strings through its tokenizer).
"""

import atexit
from dataclasses import fields

import torch.multiprocessing as mp
from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, model, **kwargs):
        config_fields = {field.name for field in fields(Config)}
        config = Config(model, **{k: v for k, v in kwargs.items() if k in config_fields})
        Sequence.block_size = config.kvcache_block_size
        self.ps = []
        self.events = []
        ctx = mp.get_context("spawn")
        for i in range(1, config.tensor_parallel_size):
            event = ctx.Event()
            process = ctx.Process(target=ModelRunner, args=(config, i, event))
            process.start()
            self.ps.append(process)
            self.events.append(event)
        self.model_runner = ModelRunner(config, 0, self.events)
        self.scheduler = Scheduler(config)
        atexit.register(self.exit)

    def exit(self):
        self.model_runner.call("exit")
        del self.model_runner
        for p in self.ps:
            p.join()

    def add_request(self, prompt: list[int], sampling_params: SamplingParams):
        self.scheduler.add(Sequence(prompt, sampling_params))

    def step(self):
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        token_ids = self.model_runner.call("run", seqs, is_prefill)
        self.scheduler.postprocess(seqs, token_ids, is_prefill)
        outputs = [(seq.seq_id, seq.completion_token_ids) for seq in seqs if seq.is_finished]
        return outputs, num_tokens

    def is_finished(self):
        return self.scheduler.is_finished()

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams, use_tqdm: bool = False):
        for prompt in prompts:
            self.add_request(prompt, sampling_params)
        outputs = {}
        while not self.is_finished():
            output, _ = self.step()
            for seq_id, token_ids in output:
                outputs[seq_id] = token_ids
        return [{"token_ids": outputs[seq_id]} for seq_id in sorted(outputs)]

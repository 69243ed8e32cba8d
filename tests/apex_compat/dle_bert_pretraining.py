"""A BERT pretraining loop in the style of NVIDIA DeepLearningExamples'
PyTorch/LanguageModeling/BERT/run_pretraining.py, written for apex (imports, calls and apex internals as that
script uses them), run unmodified by tests/apex_compat/test_dle_bert_script.py through ``python -m fp16kit run``.
Not a copy: a tiny BERT-like model in plain torch, four synthetic batches (chosen by the step), and the same
control flow:

* ``amp.initialize(model, FusedLAMB, opt_level="O2", loss_scale="dynamic", cast_model_outputs=torch.float16)`` and
  ``amp._amp_state.loss_scalers[0]._loss_scale = args.init_loss_scale``;
* ``amp.scale_loss(loss, optimizer, delay_overflow_check=args.allreduce_post_accumulation)`` per micro-batch;
* ``take_optimizer_step``: with ``--allreduce_post_accumulation`` the flat all-reduce of the master grads with
  ``amp_C.multi_tensor_scale`` / ``apex_C.unflatten`` / ``_overflow_buf`` / ``update_scale()`` (and DLE's
  ``_overfloat_buf`` typo), else a plain ``optimizer.step()``; clipping of ``amp.master_params`` first;
* checkpoints with the model, the optimizer, ``'master params'`` and ``amp.state_dict()``, resumed as DLE resumes
  (``_lazy_init_maybe_master_weights``, ``lazy_init_called``, two optimizer loads, masters copied back).

``--overflow_at_step N`` makes the loss of micro-batch N inf (an overflowed, skipped step): a test hook.
"""

import argparse
import os

import amp_C
import apex_C
import torch
import torch.nn as nn
import torch.nn.functional as F
from apex import amp
from apex.amp import _amp_state
from apex.multi_tensor_apply import multi_tensor_applier
from apex.optimizers import FusedLAMB
from apex.parallel import DistributedDataParallel as DDP  # noqa: F401  (imported as DLE does)
from apex.parallel.distributed import flat_dist_call

skipped_steps = 0
VOCAB, SEQ, HIDDEN = 64, 16, 32


class TinyBertForPreTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        layer = nn.TransformerEncoderLayer(HIDDEN, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)
        self.nsp_head = nn.Linear(HIDDEN, 2)

    def forward(self, input_ids):
        h = self.encoder(self.embed(input_ids) + self.pos)
        return self.lm_head(h), self.nsp_head(h[:, 0])


class BertPretrainingCriterion(nn.Module):
    def forward(self, prediction_scores, seq_relationship_score, masked_lm_labels, next_sentence_labels):
        mlm = F.cross_entropy(prediction_scores.float().view(-1, VOCAB), masked_lm_labels.view(-1), ignore_index=-1)
        nsp = F.cross_entropy(seq_relationship_score.float().view(-1, 2), next_sentence_labels.view(-1))
        return mlm + nsp


def batch_for(step, batch_size):
    g = torch.Generator().manual_seed(1000 + step % 4)  # four batches, seen again and again: learnable
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    labels = torch.full_like(ids, -1)
    labels[:, 1::4] = ids[:, 1::4]
    nsp = torch.randint(0, 2, (batch_size,), generator=g)
    return ids, labels, nsp


def get_world_size():
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def parse_arguments():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--train_batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--max_steps", type=int, default=6)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--allreduce_post_accumulation", action="store_true")
    p.add_argument("--init_loss_scale", type=int, default=2**20)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--num_steps_per_checkpoint", type=int, default=3)
    p.add_argument("--resume_from_checkpoint", action="store_true")
    p.add_argument("--resume_step", type=int, default=-1)
    p.add_argument("--overflow_at_step", type=int, default=-1)
    return p.parse_args()


def prepare_model_and_optimizer(args):
    torch.manual_seed(0)
    model = TinyBertForPreTraining()
    checkpoint = None
    global_step = 0
    if args.resume_from_checkpoint:
        global_step = args.resume_step
        checkpoint = torch.load(os.path.join(args.output_dir, f"ckpt_{global_step}.pt"), map_location="cpu",
                                weights_only=False)
        model.load_state_dict(checkpoint["model"], strict=False)
    param_optimizer = list(model.named_parameters())
    no_decay = ["bias", "norm"]
    groups = [
        {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = FusedLAMB(groups, lr=args.learning_rate)
    if args.fp16:
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic",
                                          cast_model_outputs=torch.float16, verbosity=0)
        amp._amp_state.loss_scalers[0]._loss_scale = args.init_loss_scale
    if args.resume_from_checkpoint:
        optimizer.load_state_dict(checkpoint["optimizer"])
        if args.fp16:
            optimizer._lazy_init_maybe_master_weights()
            optimizer._amp_stash.lazy_init_called = True
            optimizer.load_state_dict(checkpoint["optimizer"])
            for param, saved_param in zip(amp.master_params(optimizer), checkpoint["master params"]):
                param.data.copy_(saved_param.data)
            amp.load_state_dict(checkpoint["amp"])
    if args.allreduce_post_accumulation:
        flat_dist_call([param.data for param in model.parameters()], torch.distributed.broadcast, (0,))
    training_steps = checkpoint["training_steps"] if checkpoint is not None else 0  # DLE keeps its data position
    return model, optimizer, global_step, training_steps, BertPretrainingCriterion()


def take_optimizer_step(args, optimizer, model, overflow_buf, global_step):
    global skipped_steps
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.max_grad_norm)
    if args.allreduce_post_accumulation:
        loss_scale = _amp_state.loss_scalers[0].loss_scale() if args.fp16 else 1
        master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
        flat_grad_size = sum(p.numel() for p in master_grads)
        flat_raw = torch.empty(flat_grad_size, dtype=torch.float32)
        allreduced_views = apex_C.unflatten(flat_raw, master_grads)
        overflow_buf.zero_()
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [master_grads, allreduced_views],
                             loss_scale / (get_world_size() * args.gradient_accumulation_steps))
        torch.distributed.all_reduce(flat_raw)
        overflow_buf.zero_()
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [allreduced_views, master_grads],
                             1.0 / loss_scale)
        if args.fp16:
            scaler = _amp_state.loss_scalers[0]
            old_overflow_buf = scaler._overflow_buf
            scaler._overflow_buf = overflow_buf
            had_overflow = scaler.update_scale()
            scaler._overfloat_buf = old_overflow_buf  # sic: DLE's typo, kept
        else:
            had_overflow = 0
        if had_overflow == 0:
            optimizer.step()
            global_step += 1
        else:
            skipped_steps += 1
            print(f"skipped step, loss scale now {_amp_state.loss_scalers[0].loss_scale()}")
            if _amp_state.opt_properties.master_weights:
                for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                    param.grad = None
        for param in model.parameters():
            param.grad = None
    else:
        optimizer.step()
        for param in model.parameters():
            param.grad = None
        global_step += 1
    return global_step


def main():
    args = parse_arguments()
    if args.allreduce_post_accumulation:
        torch.distributed.init_process_group("gloo", init_method="file://" + os.path.join(args.output_dir, "pg"),
                                             rank=0, world_size=1)
    model, optimizer, global_step, training_steps, criterion = prepare_model_and_optimizer(args)
    overflow_buf = torch.zeros(1, dtype=torch.int32) if args.allreduce_post_accumulation else None
    model.train()
    while global_step < args.max_steps:
        training_steps += 1
        ids, labels, nsp = batch_for(training_steps, args.train_batch_size)
        prediction_scores, seq_relationship_score = model(ids)
        loss = criterion(prediction_scores, seq_relationship_score, labels, nsp)
        if training_steps == args.overflow_at_step:
            loss = loss * float("inf")
        if args.gradient_accumulation_steps > 1 and not args.allreduce_post_accumulation:
            loss = loss / args.gradient_accumulation_steps
        if args.fp16:
            with amp.scale_loss(loss, optimizer, delay_overflow_check=args.allreduce_post_accumulation) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        if training_steps % args.gradient_accumulation_steps == 0:
            before = global_step
            global_step = take_optimizer_step(args, optimizer, model, overflow_buf, global_step)
            print(f"step {global_step} loss {loss.item():.6f}")
            if global_step != before and global_step % args.num_steps_per_checkpoint == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "master params": list(amp.master_params(optimizer)), "amp": amp.state_dict(),
                            "training_steps": training_steps},
                           os.path.join(args.output_dir, f"ckpt_{global_step}.pt"))
    print(f"done: global_step {global_step} skipped_steps {skipped_steps}")


if __name__ == "__main__":
    main()

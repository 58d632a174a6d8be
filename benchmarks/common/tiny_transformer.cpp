#include "common/tiny_transformer.h"

#include <ATen/CPUGeneratorImpl.h>

#include <amp/recompute/activation_checkpoint.h>
#include <amp/recompute/checkpointed.h>
#include <ddp/fsdp/sharded_unit.h>

namespace bench {

TransformerBlockImpl::TransformerBlockImpl(const TinyTransformerOptions& options) : num_heads(options.num_heads()) {
  const int64_t d = options.d_model();
  TORCH_CHECK(d % num_heads == 0, "d_model (", d, ") must be a multiple of num_heads (", num_heads, ")");
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  qkv = register_module("qkv", amp::Float8Linear(d, 3 * d));
  proj = register_module("proj", amp::Float8Linear(d, d));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  fc1 = register_module("fc1", amp::Float8Linear(d, options.mlp_ratio() * d));
  fc2 = register_module("fc2", amp::Float8Linear(options.mlp_ratio() * d, d));
}

torch::Tensor TransformerBlockImpl::forward(torch::Tensor x) {
  const int64_t batch = x.size(0), seq = x.size(1), d = x.size(2);
  // [B, T, 3D] -> three [B, H, T, D/H] views, the layout scaled_dot_product_attention expects.
  auto heads = qkv(ln1(x)).view({batch, seq, 3, num_heads, d / num_heads}).permute({2, 0, 3, 1, 4});
  auto attended = torch::scaled_dot_product_attention(heads[0], heads[1], heads[2], /*attn_mask=*/{},
                                                      /*dropout_p=*/0.0, /*is_causal=*/true);
  x = x + proj(attended.transpose(1, 2).reshape({batch, seq, d}));
  return x + fc2(torch::gelu(fc1(ln2(x))));
}

TinyTransformerImpl::TinyTransformerImpl(const TinyTransformerOptions& opts) : options(opts) {
  token_embedding = register_module("token_embedding", torch::nn::Embedding(opts.vocab_size(), opts.d_model()));
  position_embedding = register_module("position_embedding", torch::nn::Embedding(opts.seq_len(), opts.d_model()));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < opts.num_layers(); ++i) {
    TransformerBlock block(opts);
    if (!opts.sharded_blocks()) {
      blocks->push_back(block);
    } else if (opts.activation_checkpointing()) {
      blocks->push_back(ddp::ShardedUnit(amp::Checkpointed(block)));
    } else {
      blocks->push_back(ddp::ShardedUnit(block));
    }
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({opts.d_model()})));
  head = register_module("head", amp::Float8Linear(opts.d_model(), opts.vocab_size()));
}

torch::Tensor TinyTransformerImpl::forward(torch::Tensor tokens) {
  const int64_t seq = tokens.size(1);
  TORCH_CHECK(seq <= options.seq_len(), "sequence of ", seq, " tokens is longer than seq_len ", options.seq_len());
  auto x = token_embedding(tokens) + position_embedding(torch::arange(seq, tokens.options()));
  for (const auto& module : *blocks) {
    if (options.sharded_blocks()) {  // (the unit checkpoints inside, when asked to)
      x = module->as<ddp::ShardedUnitImpl>()->forward(x);
      continue;
    }
    auto block = std::dynamic_pointer_cast<TransformerBlockImpl>(module);
    x = options.activation_checkpointing()
            ? amp::activation_checkpoint([block](const torch::Tensor& in) { return block->forward(in); }, x)
            : block->forward(x);
  }
  return head(ln_f(x));
}

torch::Tensor synthetic_token_sequences(int64_t num_sequences, int64_t seq_len, int64_t vocab_size, uint64_t seed,
                                        double rule_probability) {
  TORCH_CHECK(num_sequences > 0 && seq_len > 0 && vocab_size > 1, "synthetic tokens need num_sequences > 0 (got ",
              num_sequences, "), seq_len > 0 (got ", seq_len, ") and vocab_size > 1 (got ", vocab_size, ")");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto successor = torch::randperm(vocab_size, gen, torch::kInt64);
  auto tokens = torch::empty({num_sequences, seq_len + 1}, torch::kInt64);
  tokens.select(1, 0).copy_(torch::randint(0, vocab_size, {num_sequences}, gen, torch::kInt64));
  for (int64_t t = 0; t < seq_len; ++t) {
    const auto follow_rule = torch::rand({num_sequences}, gen) < rule_probability;
    const auto random_token = torch::randint(0, vocab_size, {num_sequences}, gen, torch::kInt64);
    tokens.select(1, t + 1).copy_(
        torch::where(follow_rule, successor.index_select(0, tokens.select(1, t)), random_token));
  }
  return tokens;
}

}  // namespace bench

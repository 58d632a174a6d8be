#pragma once

// A small GPT-style model for the AMP benchmark: where half-precision matrix units matter (the CNN is too small
// to keep a GPU's tensor cores busy). benchmarks/peers/torch_amp_peer.py builds the same architecture.

#include <cstdint>

#include <torch/torch.h>

#include <amp/nn/float8_linear.h>

namespace bench {

/// Sizes of TinyTransformer (quick-mode defaults; amp_vs_fp32 --full uses larger ones).
struct TinyTransformerOptions {
  TORCH_ARG(int64_t, vocab_size) = 512;
  TORCH_ARG(int64_t, seq_len) = 64;  // tokens per sequence (the positional table's length)
  TORCH_ARG(int64_t, d_model) = 128;
  TORCH_ARG(int64_t, num_heads) = 4;
  TORCH_ARG(int64_t, num_layers) = 2;
  TORCH_ARG(int64_t, mlp_ratio) = 4;  // hidden width of the MLP = mlp_ratio * d_model
  /// Each block under amp::activation_checkpoint in a forward with grad: it keeps only its input, and its
  /// activations are rebuilt in backward (torchtitan's per-block activation checkpointing).
  TORCH_ARG(bool, activation_checkpointing) = false;
  /// Each block in a ddp::ShardedUnit (a unit of full sharding; with activation_checkpointing the checkpoint is
  /// inside the unit). The parameters keep their names; until a ddp::FullyShardedDataParallel is built over the model
  /// it computes exactly as without.
  TORCH_ARG(bool, sharded_blocks) = false;
};

/// One pre-LN block: x + proj(causal_attention(ln1(x))), then x + fc2(gelu(fc1(ln2(x)))).
struct TransformerBlockImpl : torch::nn::Module {
  explicit TransformerBlockImpl(const TinyTransformerOptions& options);
  /// x: [batch, seq, d_model] -> same shape.
  torch::Tensor forward(torch::Tensor x);

  int64_t num_heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  /// amp::Float8Linear: exactly torch::nn::Linear until amp::Options::fp8 turns their GEMMs to FP8.
  amp::Float8Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TransformerBlock);

/// Token + learned position embeddings, num_layers pre-LN blocks, a final LayerNorm and an untied LM head.
struct TinyTransformerImpl : torch::nn::Module {
  explicit TinyTransformerImpl(const TinyTransformerOptions& options = {});
  /// tokens: [batch, seq <= seq_len] int64 -> logits [batch, seq, vocab_size].
  torch::Tensor forward(torch::Tensor tokens);

  TinyTransformerOptions options;
  torch::nn::Embedding token_embedding{nullptr}, position_embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  amp::Float8Linear head{nullptr};
};
TORCH_MODULE(TinyTransformer);

/// `num_sequences` sequences of seq_len + 1 tokens from a fixed random bigram rule (each token has one likely
/// successor, taken with probability `rule_probability`, else a uniform token), so next-token loss can fall
/// well below log(vocab_size). Deterministic in `seed`; int64 on the CPU.
constexpr double kBigramRuleProbability = 0.875;
torch::Tensor synthetic_token_sequences(int64_t num_sequences, int64_t seq_len, int64_t vocab_size, uint64_t seed,
                                        double rule_probability = kBigramRuleProbability);

}  // namespace bench

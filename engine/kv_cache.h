// Paged KV cache: one pool of fixed-size blocks shared by many sequences.
//
// The idea is vLLM's PagedAttention (Kwon et al., SOSP 2023): a sequence holds a block
// table instead of a contiguous [ctx, kv_dim] slab, so it reserves memory only for the tokens
// it has, and a finished sequence returns its blocks at once.
#pragma once
#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/buffer.h"
#include "models/config.h"

namespace llmq {

/// Element type of the KV cache: fp32, or bf16 (half the bytes; attention then multiplies bf16
/// q·k and softmax·v pairs with fp32 sums: attn_scores_bf16 / attn_accumulate_bf16 in
/// engine/cpu/cpu_ops.h, which also gives the paired block layouts). llama.cpp's default KV cache is
/// f16 for the same reason.
enum class KvType { F32, BF16 };

/// "f32" or "bf16".
const char* kv_type_name(KvType t);
/// Parses "f32" or "bf16"; throws UsageError for anything else.
KvType kv_type_from_name(const std::string& name);
/// Bytes per element: 4 or 2.
inline int kv_elem_bytes(KvType t) { return t == KvType::BF16 ? 2 : 4; }

class KVCache {
 public:
  /// A pool of n_blocks blocks of block_tokens positions, fp32, laid out per layer and KV
  /// head: [n_layers, n_kv_heads, n_blocks] blocks, so that one head's blocks of one layer are
  /// adjacent (a sequence's blocks, taken in order from a fresh pool, form one sequential
  /// stream per head). Per block, V is [block_tokens, head_dim] and K is stored transposed,
  /// [head_dim, block_tokens] (element (j, p) = dimension j of the block's position p), so
  /// attention scores are vectorized along positions (llmq::attn_scores).
  /// With KvType::BF16 the blocks hold bf16 pairs instead (K [head_dim/2, block_tokens, 2],
  /// V [block_tokens/2, head_dim, 2]; block_tokens must be even).
  /// Throws UsageError for non-positive sizes.
  KVCache(const ModelConfig& c, int64_t n_blocks, int64_t block_tokens = 16, KvType type = KvType::F32);
  /// Tensor parallelism: one K and V pool per rank, pool r with rank r's KV width
  /// shard_kv_dims[r] (its KV heads x head_dim), all sharing one block table, so a sequence's
  /// block b is block b of every pool. Throws UsageError for non-positive sizes.
  KVCache(const ModelConfig& c, int64_t n_blocks, int64_t block_tokens, const std::vector<int64_t>& shard_kv_dims,
          KvType type = KvType::F32);

  /// The block bookkeeping alone (block tables, free list, lengths), with no K and V pools
  /// (bytes() == 0, n_shards() == 0): for a cache whose storage lives elsewhere, a GPU's paged
  /// cache (engine/cuda/session.h); key_block and store must not be called on it.
  /// Throws UsageError for non-positive sizes.
  static KVCache tables_only(const ModelConfig& c, int64_t n_blocks, int64_t block_tokens);

  KvType type() const { return type_; }

  int64_t block_tokens() const { return bt_; }
  int64_t n_blocks() const { return n_blocks_; }
  int64_t free_blocks() const { return int64_t(free_.size() + lru_.size()); }
  /// Bytes of the K and V pools (all ranks).
  uint64_t bytes() const;
  /// Bytes of rank r's K and V pools.
  uint64_t shard_bytes(int r) const { return k_.at(size_t(r)).bytes() + v_.at(size_t(r)).bytes(); }
  /// Pools (tensor-parallel ranks): 1 unless built with shard_kv_dims.
  int n_shards() const { return int(k_.size()); }
  /// Blocks needed for n positions.
  int64_t blocks_for(int64_t n) const { return (n + bt_ - 1) / bt_; }

  /// A new empty sequence; returns its id (ids of removed sequences are reused).
  int32_t add_sequence();
  /// Frees the sequence and its blocks. Unknown ids are ignored.
  void remove_sequence(int32_t seq);
  /// Ensures positions [0, n) of seq have blocks; returns false, changing nothing, when the
  /// pool has too few free blocks.
  bool reserve(int32_t seq, int64_t n);
  /// Positions cached for seq (positions 0 .. length-1 hold K and V).
  int64_t length(int32_t seq) const { return seqs_.at(size_t(seq)).length; }
  /// Sets the cached length (forward() advances it; n <= reserved capacity).
  void set_length(int32_t seq, int64_t n);
  /// Keeps the first n positions of seq and frees the blocks past them.
  void truncate(int32_t seq, int64_t n);
  /// Makes seq (created if new) hold exactly `blocks` [n_blocks] at `length` positions: a
  /// follower's copy of another cache's table (tensor parallelism over processes: rank 0's cache
  /// allocates, the other ranks mirror its tables into their own pools before each forward
  /// pass). A follower never allocates, so its free list is not kept. Throws UsageError for a
  /// block id outside the pool or a length beyond the blocks.
  void mirror(int32_t seq, const int32_t* blocks, int64_t n_blocks, int64_t length);
  // ---- automatic prefix caching (vLLM's, Kwon et al. 2023, section 4.4 and the vLLM v1
  // design): a full block whose K and V came from a known run of tokens is registered under
  // the chain hash of all the tokens up to its end; a new sequence whose prompt starts with
  // the same tokens takes those blocks (shared, read-only: a sequence writes only past its
  // length) instead of computing them again. A registered block nobody holds stays cached and
  // is evicted least recently used when a sequence needs a free block; free_blocks() counts it.

  /// Turns prefix caching on (off by default: sessions truncate and rewrite their blocks).
  void enable_prefix_cache() {
    prefix_cache_ = true;
    cached_.resize(size_t(n_blocks_));
  }
  bool prefix_cache() const { return prefix_cache_; }
  /// Gives the new, empty sequence seq the cached blocks that hold the longest prefix of
  /// tokens [n] made of whole blocks, leaving at least one token to compute (its logits are
  /// needed); sets its length and returns the positions it holds (0 without a match or with
  /// prefix caching off). Tokens and the chain of hashes are both compared: never a wrong block.
  int64_t attach_prefix(int32_t seq, const int32_t* tokens, int64_t n);
  /// Registers seq's full blocks among its first n positions, whose K and V came from
  /// tokens [n], so later sequences can attach them. Blocks already registered are skipped.
  void register_prefix(int32_t seq, const int32_t* tokens, int64_t n);
  /// Blocks registered (held or cached) and cached ones nobody holds.
  int64_t prefix_blocks() const { return int64_t(by_hash_.size()); }
  int64_t evictable_blocks() const { return int64_t(lru_.size()); }

  /// The block table of seq: block i holds positions [i · block_tokens, (i + 1) · block_tokens).
  const std::vector<int32_t>& blocks(int32_t seq) const { return seqs_.at(size_t(seq)).blocks; }
  /// Positions seq can hold without reserving more.
  int64_t capacity(int32_t seq) const { return int64_t(seqs_.at(size_t(seq)).blocks.size()) * bt_; }

  /// K of one layer and KV head (numbered within the pool) for a block of seq in pool `shard`:
  /// [head_dim, block_tokens] (transposed), positions block*block_tokens ... The block must be
  /// reserved.
  float* key_block(int64_t layer, int32_t seq, int64_t block, int64_t kv_head, int shard = 0) {
    return reinterpret_cast<float*>(k_[size_t(shard)].data()) + offset(layer, kv_head, seqs_[size_t(seq)].blocks[size_t(block)], shard);
  }
  /// V of the same: [block_tokens, head_dim].
  float* value_block(int64_t layer, int32_t seq, int64_t block, int64_t kv_head, int shard = 0) {
    return reinterpret_cast<float*>(v_[size_t(shard)].data()) + offset(layer, kv_head, seqs_[size_t(seq)].blocks[size_t(block)], shard);
  }
  /// The same blocks of a KvType::BF16 cache: K [head_dim/2, block_tokens, 2], V
  /// [block_tokens/2, head_dim, 2] (pairs for `vdpbf16ps`, engine/cpu/cpu_ops.h).
  uint16_t* key_block_bf16(int64_t layer, int32_t seq, int64_t block, int64_t kv_head, int shard = 0) {
    return reinterpret_cast<uint16_t*>(k_[size_t(shard)].data()) + offset(layer, kv_head, seqs_[size_t(seq)].blocks[size_t(block)], shard);
  }
  uint16_t* value_block_bf16(int64_t layer, int32_t seq, int64_t block, int64_t kv_head, int shard = 0) {
    return reinterpret_cast<uint16_t*>(v_[size_t(shard)].data()) + offset(layer, kv_head, seqs_[size_t(seq)].blocks[size_t(block)], shard);
  }
  int64_t kv_dim(int shard = 0) const { return kv_dim_[size_t(shard)]; }

  /// Writes one token's K and V (k, v [kv_dim(shard)], its KV heads one after the other) at
  /// position `pos` of seq in layer `layer` of pool `shard`, in this cache's block layout (f32: K
  /// transposed; bf16: rounded to nearest even and paired). The position's block must be reserved.
  void store(int64_t layer, int32_t seq, int64_t pos, const float* k, const float* v, int shard = 0);

 private:
  struct Seq {
    bool live = false;
    int64_t length = 0;
    std::vector<int32_t> blocks;  // block table: block i holds positions [i*bt, (i+1)*bt)
    int64_t hashed = 0;           // prefix caching: leading blocks whose chain hash is known
    uint64_t chain = 0;           // the chain hash through block hashed - 1
  };
  // A registered block: the chain hash of the tokens through it, its parent's, and its tokens.
  struct Cached {
    bool registered = false;
    uint64_t hash = 0, parent = 0;
    std::vector<int32_t> tokens;
    std::list<int32_t>::iterator lru;  // its place in lru_ while nobody holds it
  };
  int32_t take_block();          // a free block, else the least recently used cached one
  void release_block(int32_t b);  // a sequence lets go of b
  uint64_t chain_hash(uint64_t parent, const int32_t* tokens) const;
  KVCache(const ModelConfig& c, int64_t n_blocks, int64_t block_tokens, const std::vector<int64_t>& shard_kv_dims, KvType type,
          bool allocate);
  size_t offset(int64_t layer, int64_t kv_head, int32_t block, int shard) const {
    const size_t heads = size_t(kv_dim_[size_t(shard)] / head_dim_);
    return ((size_t(layer) * heads + size_t(kv_head)) * size_t(n_blocks_) + size_t(block)) * size_t(bt_ * head_dim_);
  }
  int64_t n_layers_, head_dim_, bt_, n_blocks_;
  KvType type_;
  std::vector<int64_t> kv_dim_;           // [shards]
  std::vector<HugeBuffer> k_, v_;  // [shards] [n_layers, kv_heads(shard), n_blocks, block] f32 or bf16
  std::vector<int32_t> free_;    // free block ids
  std::vector<Seq> seqs_;
  bool prefix_cache_ = false;
  std::vector<int32_t> ref_;                     // [n_blocks] sequences holding each block
  std::vector<Cached> cached_;                   // [n_blocks] (prefix caching only)
  std::unordered_map<uint64_t, int32_t> by_hash_;  // chain hash -> registered block
  std::list<int32_t> lru_;                       // registered blocks nobody holds, oldest first
};

}  // namespace llmq

#include "engine/kv_cache.h"

#include <algorithm>
#include <cstring>

#include <xxhash.h>

#include "engine/cpu/cpu_ops.h"
#include "base/error.h"

namespace llmq {

const char* kv_type_name(KvType t) { return t == KvType::BF16 ? "bf16" : "f32"; }

KvType kv_type_from_name(const std::string& name) {
  if (name == "f32") return KvType::F32;
  if (name == "bf16") return KvType::BF16;
  throw UsageError("KV cache type must be f32 or bf16, not '" + name + "'");
}

KVCache::KVCache(const ModelConfig& c, int64_t n_blocks, int64_t block_tokens, KvType type)
    : KVCache(c, n_blocks, block_tokens, std::vector<int64_t>{c.kv_dim()}, type) {}

KVCache::KVCache(const ModelConfig& c, int64_t n_blocks, int64_t block_tokens, const std::vector<int64_t>& shard_kv_dims,
                 KvType type)
    : KVCache(c, n_blocks, block_tokens, shard_kv_dims, type, true) {}

KVCache KVCache::tables_only(const ModelConfig& c, int64_t n_blocks, int64_t block_tokens) {
  return KVCache(c, n_blocks, block_tokens, {c.kv_dim()}, KvType::F32, false);
}

KVCache::KVCache(const ModelConfig& c, int64_t n_blocks, int64_t block_tokens, const std::vector<int64_t>& shard_kv_dims,
                 KvType type, bool allocate)
    : n_layers_(c.n_layers), head_dim_(c.head_dim), bt_(block_tokens), n_blocks_(n_blocks), type_(type), kv_dim_(shard_kv_dims) {
  if (n_blocks <= 0 || block_tokens <= 0 || kv_dim_.empty() || head_dim_ <= 0)
    throw UsageError("KV cache: block count, block size and pool count must be positive");
  if (type == KvType::BF16 && (block_tokens % 2 != 0 || head_dim_ % 2 != 0))
    throw UsageError("KV cache: bf16 blocks pair positions and dimensions (block size and head_dim must be even)");
  for (int64_t d : kv_dim_)
    if (d % head_dim_ != 0) throw UsageError("KV cache: a pool's width is not a whole number of KV heads");
  for (int64_t d : allocate ? kv_dim_ : std::vector<int64_t>{}) {
    const size_t elems = size_t(n_blocks) * size_t(n_layers_) * size_t(bt_) * size_t(d);
    k_.emplace_back(elems * size_t(kv_elem_bytes(type)));  // zero-filled, huge pages (base/buffer.h)
    v_.emplace_back(elems * size_t(kv_elem_bytes(type)));
  }
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(int32_t(b));
  ref_.assign(size_t(n_blocks), 0);
}

void KVCache::store(int64_t layer, int32_t seq, int64_t pos, const float* k, const float* v, int shard) {
  constexpr int64_t kMaxHeadDim = 4096;  // the bound ModelConfig checks (models/llama.cpp)
  const int64_t hd = head_dim_, blk = pos / bt_, slot = pos % bt_;
  for (int64_t h = 0; h < kv_dim_[size_t(shard)] / hd; ++h, k += hd, v += hd) {
    if (type_ == KvType::BF16) {  // K [hd/2, bt, 2], V [bt/2, hd, 2]
      uint16_t kv16[2 * kMaxHeadDim];
      to_bf16(kv16, k, hd);
      to_bf16(kv16 + hd, v, hd);
      uint16_t* kb = key_block_bf16(layer, seq, blk, h, shard);
      uint16_t* vb = value_block_bf16(layer, seq, blk, h, shard) + (slot / 2) * hd * 2 + slot % 2;
      for (int64_t d = 0; d < hd; ++d) {
        kb[((d / 2) * bt_ + slot) * 2 + d % 2] = kv16[d];
        vb[2 * d] = kv16[hd + d];
      }
    } else {  // K [hd, bt] (transposed), V [bt, hd]
      float* kT = key_block(layer, seq, blk, h, shard);
      for (int64_t d = 0; d < hd; ++d) kT[d * bt_ + slot] = k[d];
      std::memcpy(value_block(layer, seq, blk, h, shard) + slot * hd, v, size_t(hd) * sizeof(float));
    }
  }
}

uint64_t KVCache::bytes() const {
  uint64_t n = 0;
  for (size_t s = 0; s < k_.size(); ++s) n += shard_bytes(int(s));
  return n;
}

int32_t KVCache::add_sequence() {
  for (size_t i = 0; i < seqs_.size(); ++i)
    if (!seqs_[i].live) {
      seqs_[i] = Seq{true, 0, {}};
      return int32_t(i);
    }
  seqs_.push_back(Seq{true, 0, {}});
  return int32_t(seqs_.size() - 1);
}

void KVCache::remove_sequence(int32_t seq) {
  if (seq < 0 || size_t(seq) >= seqs_.size() || !seqs_[size_t(seq)].live) return;
  Seq& s = seqs_[size_t(seq)];
  for (int32_t b : s.blocks) release_block(b);
  s = Seq{};
}

int32_t KVCache::take_block() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {  // evict the least recently used cached block
    b = lru_.front();
    lru_.pop_front();
    Cached& c = cached_[size_t(b)];
    by_hash_.erase(c.hash);
    c = Cached{};
  }
  ref_[size_t(b)] = 1;
  return b;
}

void KVCache::release_block(int32_t b) {
  if (--ref_[size_t(b)] > 0) return;
  ref_[size_t(b)] = 0;  // (a follower's mirrored tables hold no counts)
  if (prefix_cache_ && cached_[size_t(b)].registered) {
    cached_[size_t(b)].lru = lru_.insert(lru_.end(), b);  // stays cached until needed
  } else {
    free_.push_back(b);
  }
}

bool KVCache::reserve(int32_t seq, int64_t n) {
  Seq& s = seqs_.at(size_t(seq));
  const int64_t need = blocks_for(n) - int64_t(s.blocks.size());
  if (need <= 0) return true;
  if (need > free_blocks()) return false;
  for (int64_t i = 0; i < need; ++i) s.blocks.push_back(take_block());
  return true;
}

uint64_t KVCache::chain_hash(uint64_t parent, const int32_t* tokens) const {
  return XXH64(tokens, size_t(bt_) * sizeof(int32_t), parent ^ 0x9e3779b97f4a7c15ull);
}

int64_t KVCache::attach_prefix(int32_t seq, const int32_t* tokens, int64_t n) {
  Seq& s = seqs_.at(size_t(seq));
  if (!prefix_cache_ || !s.blocks.empty() || s.length != 0) return 0;
  uint64_t parent = 0;
  for (int64_t i = 0; (i + 1) * bt_ <= n - 1; ++i) {  // whole blocks, and at least one token left
    const int32_t* t = tokens + i * bt_;
    const uint64_t h = chain_hash(parent, t);
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    Cached& c = cached_[size_t(it->second)];
    if (c.parent != parent || !std::equal(c.tokens.begin(), c.tokens.end(), t)) break;  // a hash collision
    if (ref_[size_t(it->second)]++ == 0) lru_.erase(c.lru);
    s.blocks.push_back(it->second);
    parent = h;
  }
  s.length = int64_t(s.blocks.size()) * bt_;
  s.hashed = int64_t(s.blocks.size()), s.chain = parent;
  return s.length;
}

void KVCache::register_prefix(int32_t seq, const int32_t* tokens, int64_t n) {
  Seq& s = seqs_.at(size_t(seq));
  if (!prefix_cache_) return;
  for (; (s.hashed + 1) * bt_ <= std::min(n, s.length) && s.hashed < int64_t(s.blocks.size()); ++s.hashed) {
    const int32_t* t = tokens + s.hashed * bt_;
    const uint64_t h = chain_hash(s.chain, t);
    const int32_t b = s.blocks[size_t(s.hashed)];
    Cached& c = cached_[size_t(b)];
    if (!c.registered && !by_hash_.count(h)) {  // the first block with these contents is the one kept
      c.registered = true, c.hash = h, c.parent = s.chain;
      c.tokens.assign(t, t + bt_);
      by_hash_[h] = b;
    }
    s.chain = h;
  }
}

void KVCache::set_length(int32_t seq, int64_t n) {
  Seq& s = seqs_.at(size_t(seq));
  if (n < 0 || n > capacity(seq)) throw UsageError("KV cache: length beyond the reserved blocks");
  s.length = n;
}

void KVCache::truncate(int32_t seq, int64_t n) {
  Seq& s = seqs_.at(size_t(seq));
  if (n < 0) n = 0;
  if (n < s.length) s.length = n;
  const int64_t keep = blocks_for(s.length);
  while (int64_t(s.blocks.size()) > keep) {
    release_block(s.blocks.back());
    s.blocks.pop_back();
  }
  if (prefix_cache_ && s.hashed * bt_ > s.length) {  // the kept part of a block may be rewritten: forget it
    if (s.length % bt_ != 0 && !s.blocks.empty()) {
      const int32_t b = s.blocks.back();
      if (ref_[size_t(b)] > 1) throw UsageError("KV cache: truncating inside a block other sequences share");
      if (cached_[size_t(b)].registered) {
        by_hash_.erase(cached_[size_t(b)].hash);
        cached_[size_t(b)] = Cached{};
      }
    }
    s.hashed = 0, s.chain = 0;  // the chain is hashed again from the start at the next registration
  }
}

void KVCache::mirror(int32_t seq, const int32_t* blocks, int64_t n_blocks, int64_t length) {
  if (seq < 0 || seq >= std::max<int64_t>(n_blocks_, 1 << 16))  // ids are reused: never more live sequences than blocks
    throw UsageError("KV cache: sequence id " + std::to_string(seq) + " out of range");
  if (n_blocks < 0 || n_blocks > n_blocks_ || length < 0 || length > n_blocks * bt_)
    throw UsageError("KV cache: a mirrored table of " + std::to_string(n_blocks) + " blocks and " + std::to_string(length) +
                     " positions does not fit this pool");
  for (int64_t i = 0; i < n_blocks; ++i)
    if (blocks[i] < 0 || blocks[i] >= n_blocks_) throw UsageError("KV cache: mirrored block id " + std::to_string(blocks[i]) + " out of range");
  if (size_t(seq) >= seqs_.size()) seqs_.resize(size_t(seq) + 1);
  seqs_[size_t(seq)] = Seq{true, length, std::vector<int32_t>(blocks, blocks + n_blocks)};
}

}  // namespace llmq

// A caching CPU allocator for large blocks, installed as torch's CPU allocator
// (c10::SetCPUAllocator) by pagedllm/kernels/cpu_ops.py:install_cpu_allocator.
//
// Why: glibc serves every allocation above its mmap threshold (at most 32 MiB, see mallopt(3),
// M_MMAP_THRESHOLD) with a fresh mmap and returns it with munmap on free, so every such tensor
// pays a page fault per 4 KiB page on first touch (~0.4 s per GB here, docs/hardware-and-models.md,
// "Measured ceilings"). A
// prefill step of 8,192 tokens allocates a 100 MB int32 GEMM output per layer: 1.1 million page
// faults and ~1.1 s of a 5.5 s prefill (benchmarks/results/performance-history-2026-11.md, step 22).
// This allocator keeps freed
// large blocks (up to a byte cap) and hands them out again, so a block's pages are faulted once.
// Its blocks are mmaps of whole 4 KiB pages; with huge_pages they are whole 2 MiB pages, 2 MiB-
// aligned and advised MADV_HUGEPAGE, so where transparent huge pages are enabled ("madvise" or
// "always") KV caches and weights get 2 MiB pages (fewer TLB misses on the scattered KV reads of
// decode attention: ~5% faster). Off
// by default: the kernel may compact memory synchronously to find huge pages on first touch,
// which made start-up up to 2.5 s slower here.
//
// Allocations under min_bytes go to the allocator that was installed before (torch's default),
// and so do their frees: raw_deallocate() reaches this allocator's deleter for every pointer,
// and a pointer this allocator did not map goes back to the base allocator's raw deleter.
// Thread-safe (one mutex; large allocations are rare); fork-safe (the mutex is held across
// fork() by pthread_atfork handlers).
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <sys/mman.h>
#include "torch_lite.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kPage = size_t(4) << 10;

class CachingCpuAllocator final : public c10::Allocator {
 public:
  CachingCpuAllocator(c10::Allocator* base, size_t min_bytes, size_t max_cached, bool huge_pages)
      : base_(base), min_bytes_(min_bytes), max_cached_(max_cached), huge_pages_(huge_pages) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_) return base_->allocate(n);
    // Whole 2 MiB pages only when they may become huge pages; else whole 4 KiB pages (rounding
    // every weight matrix up to 2 MiB cost SmolLM2 ~120 MiB of resident memory).
    const size_t gran = huge_pages_ ? kHugePage : kPage;
    const size_t size = (n + gran - 1) / gran * gran;
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      // Best fit among cached blocks, at most 25% larger than asked (a much larger block would
      // stay tied up by a small tensor).
      auto it = free_.lower_bound(size);
      if (it != free_.end() && it->first <= size + size / 4) {
        p = it->second;
        live_[p] = it->first;
        cached_ -= it->first;
        live_bytes_ += it->first;
        free_.erase(it);
        ++hits_;
      }
    }
    if (p == nullptr) {
      p = map_block(size);
      std::lock_guard<std::mutex> g(mu_);
      live_[p] = size;
      live_bytes_ += size;
      ++misses_;
    }
    return {p, p, &Delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void set_limits(size_t min_bytes, size_t max_cached, bool huge_pages) {
    std::lock_guard<std::mutex> g(mu_);
    min_bytes_ = min_bytes;
    max_cached_ = max_cached;
    huge_pages_ = huge_pages;
    trim_locked(max_cached_);
  }

  // Returns every cached (free) block to the OS.
  void empty_cache() {
    std::lock_guard<std::mutex> g(mu_);
    trim_locked(0);
  }

  std::unordered_map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> g(mu_);
    return {{"hits", hits_},
            {"misses", misses_},
            {"cached_bytes", static_cast<int64_t>(cached_)},
            {"live_bytes", static_cast<int64_t>(live_bytes_)},
            {"min_bytes", static_cast<int64_t>(min_bytes_.load())},
            {"max_cached_bytes", static_cast<int64_t>(max_cached_)},
            {"huge_pages", huge_pages_.load() ? 1 : 0}};
  }

  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

  static CachingCpuAllocator* instance;

 private:
  static void Delete(void* p) { instance->release(p); }

  void release(void* p) {
    size_t size = 0;
    bool base_free = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(p);
      if (it == live_.end()) {
        // A block under min_bytes that came from the base allocator through raw_allocate():
        // raw_deallocate() calls *our* raw_deleter() for every pointer, so it lands here and
        // must go back to the base allocator. (Returning instead leaked every small
        // raw_allocate block: oneDNN/ideep allocate their buffers and scratchpads that way,
        // ~0.5 MiB per engine step on a bf16 model.)
        base_free = true;
      } else {
        size = it->second;
        live_.erase(it);
        live_bytes_ -= size;
        if (cached_ + size <= max_cached_) {
          free_.emplace(size, p);
          cached_ += size;
          return;
        }
      }
    }
    if (base_free) {
      base_->raw_deleter()(p);
      return;
    }
    munmap(p, size);
  }

  // A fresh anonymous mapping of `size` bytes (a multiple of 4 KiB), 2 MiB-aligned when huge
  // pages are asked for (else page-aligned, which is all a tensor needs).
  void* map_block(size_t size) {
    const bool huge = huge_pages_;
    const size_t pad = huge ? kHugePage : 0;
    void* raw = mmap(nullptr, size + pad, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      empty_cache();  // cached blocks may be what is missing
      raw = mmap(nullptr, size + pad, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    TORCH_CHECK(raw != MAP_FAILED, "pagedllm CPU allocator: not enough memory: you tried to allocate ", size,
                " bytes.");
    if (!huge) return raw;
    const uintptr_t a = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (a + kHugePage - 1) / kHugePage * kHugePage;
    if (aligned > a) munmap(raw, aligned - a);
    const uintptr_t tail = a + size + kHugePage - (aligned + size);
    if (tail > 0) munmap(reinterpret_cast<void*>(aligned + size), tail);
    void* p = reinterpret_cast<void*>(aligned);
    madvise(p, size, MADV_HUGEPAGE);  // advisory: fails harmlessly where THP is off
    return p;
  }

  void trim_locked(size_t keep) {
    while (cached_ > keep && !free_.empty()) {
      auto it = std::prev(free_.end());  // largest first
      munmap(it->second, it->first);
      cached_ -= it->first;
      free_.erase(it);
    }
  }

  c10::Allocator* base_;
  std::atomic<size_t> min_bytes_;  // read without the lock by allocate / map_block
  size_t max_cached_;
  std::atomic<bool> huge_pages_;
  std::mutex mu_;
  std::multimap<size_t, void*> free_;         // cached blocks by size
  std::unordered_map<void*, size_t> live_;    // blocks in use -> size
  size_t cached_ = 0, live_bytes_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

CachingCpuAllocator* CachingCpuAllocator::instance = nullptr;

void before_fork() { CachingCpuAllocator::instance->lock(); }
void after_fork() { CachingCpuAllocator::instance->unlock(); }

}  // namespace

// Installs the allocator (once per process; later calls only change the settings). Blocks of at
// least min_bytes are cached after free while the cache holds at most max_cached_bytes; new
// blocks are advised MADV_HUGEPAGE when huge_pages.
bool install_cpu_allocator(int64_t min_bytes, int64_t max_cached_bytes, bool huge_pages) {
  TORCH_CHECK(min_bytes > 0 && max_cached_bytes >= 0, "install_cpu_allocator: min_bytes must be > 0 and "
              "max_cached_bytes >= 0");
  static std::mutex install_mu;
  std::lock_guard<std::mutex> g(install_mu);
  if (CachingCpuAllocator::instance != nullptr) {
    CachingCpuAllocator::instance->set_limits(min_bytes, max_cached_bytes, huge_pages);
    return false;
  }
  c10::Allocator* base = c10::GetCPUAllocator();
  TORCH_CHECK(base != nullptr && base->raw_deleter() != nullptr,
              "install_cpu_allocator: the current CPU allocator has no raw deleter");
  // NOTE: never deleted: tensors may be freed during interpreter shutdown, after static
  // destructors would have run.
  CachingCpuAllocator::instance =
      new CachingCpuAllocator(base, static_cast<size_t>(min_bytes),
                              static_cast<size_t>(max_cached_bytes), huge_pages);
  pthread_atfork(&before_fork, &after_fork, &after_fork);
  c10::SetCPUAllocator(CachingCpuAllocator::instance, /*priority=*/UINT8_MAX);
  return true;
}

std::unordered_map<std::string, int64_t> cpu_allocator_stats() {
  if (CachingCpuAllocator::instance == nullptr) return {};
  return CachingCpuAllocator::instance->stats();
}

void cpu_allocator_empty_cache() {
  if (CachingCpuAllocator::instance != nullptr) CachingCpuAllocator::instance->empty_cache();
}

// Reading a whole input file (a config, a checkpoint's `latest`, a JSON index, a text to
// tokenise) with one error per failure, and never blocking on a special file.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

namespace fp8moe {

// The contents of the regular file `path`. Throws Error("PATH: cannot read the WHAT: REASON")
// when it does not exist, is not a regular file (a FIFO, a device, a directory: refused before
// anything is read, and the open does not wait for a FIFO's writer), is larger than max_bytes,
// or cannot be read.
template <class Error>
std::string read_whole_file(const std::string& path, const std::string& what, uintmax_t max_bytes = UINTMAX_MAX) {
  const std::string prefix = path + ": cannot read the " + what + ": ";
  // O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer; for a regular file it
  // changes nothing.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw Error(prefix + (errno == ENOENT ? std::string("it does not exist") : std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(prefix + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "a special file";
    throw Error(prefix + "it is not a regular file (" + kind + ")");
  }
  const uintmax_t size = uintmax_t(st.st_size);
  if (size > max_bytes)
    throw Error(prefix + "it is " + std::to_string(size) + " bytes, over the limit of " + std::to_string(max_bytes) +
                " bytes for a " + what);
  std::string text(size, '\0');
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, text.data() + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(prefix + std::strerror(errno));
    if (n == 0)
      throw Error(prefix + "it ended after " + std::to_string(done) + " of " + std::to_string(size) +
                  " bytes (changed while read?)");
    done += size_t(n);
  }
  return text;
}

}  // namespace fp8moe

// Open MPI's session directories (launcher/src/processes.cpp): those whose process is gone are
// removed before an mpirun starts; those of live processes stay, whatever the process is - a
// singleton's orted keeps its PMIx store there, and MPI_Init fails in the singleton without it.
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "../../support/temp_dir.h"
#include "processes.h"

namespace hpctrial::launcher {
namespace {

namespace fs = std::filesystem;

class SessionDirs : public testing::Test {
 protected:
  void SetUp() override {
    if (const char* old = std::getenv("OMPI_MCA_orte_tmpdir_base")) saved_ = old;
    ::setenv("OMPI_MCA_orte_tmpdir_base", dir_.path().c_str(), 1);
    mine_ = fs::path(detail::session_dir(0)).parent_path();
    fs::create_directories(mine_);
  }
  void TearDown() override {
    if (saved_) {
      ::setenv("OMPI_MCA_orte_tmpdir_base", saved_->c_str(), 1);
    } else {
      ::unsetenv("OMPI_MCA_orte_tmpdir_base");
    }
  }
  // pid.<pid> with a file in it, as Open MPI leaves one.
  fs::path make(pid_t pid) const {
    const fs::path dir = fs::path(detail::session_dir(pid));
    fs::create_directories(dir / "pmix_dstor_ds21_1");
    std::ofstream(dir / "pmix_dstor_ds21_1" / "initial-pmix_shared-segment-0") << "x";
    return dir;
  }
  // A child process that has ended: reaped (gone) or not (a zombie).
  static pid_t ended_child(bool reaped) {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(0);
    if (reaped) {
      ::waitpid(pid, nullptr, 0);
    } else {
      siginfo_t info{};
      ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT);
    }
    return pid;
  }

  testing_support::TempDir dir_;
  std::optional<std::string> saved_;
  fs::path mine_;
};

TEST_F(SessionDirs, NameTheProcessUnderTheTemporaryDirectoryOfOpenMpi) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string node = host;
  node = node.substr(0, node.find('.'));
  EXPECT_EQ(detail::session_dir(1234),
            (dir_.path() / ("ompi." + node + "." + std::to_string(::getuid())) / "pid.1234").string());
}

TEST_F(SessionDirs, ThoseOfLiveProcessesStayWhateverTheProcessIs) {
  // This test's process stands for a singleton's orted: alive, and not an mpirun.
  const fs::path live = make(::getpid());
  const fs::path jobs = mine_ / "jf.4242";
  fs::create_directories(jobs);
  detail::remove_stale_session_dirs();
  EXPECT_TRUE(fs::exists(live / "pmix_dstor_ds21_1" / "initial-pmix_shared-segment-0"));
  EXPECT_TRUE(fs::exists(jobs)) << "a directory of a job family is not a process's";
}

TEST_F(SessionDirs, ThoseOfEndedProcessesGo) {
  const pid_t gone = ended_child(/*reaped=*/true);
  const pid_t zombie = ended_child(/*reaped=*/false);
  const fs::path a = make(gone), b = make(zombie);
  detail::remove_stale_session_dirs();
  ::waitpid(zombie, nullptr, 0);
  EXPECT_FALSE(fs::exists(a));
  EXPECT_FALSE(fs::exists(b)) << "a zombie has ended";
}

TEST_F(SessionDirs, OneWhoseNumberALaterProcessHasGoes) {
  // Last changed an hour before this process started: its owner had that number before us.
  const fs::path reused = make(::getpid());
  struct stat now {};
  ASSERT_EQ(::stat(reused.c_str(), &now), 0);
  const struct timeval times[2] = {{now.st_atime - 3600 - 600, 0}, {now.st_mtime - 3600 - 600, 0}};
  ASSERT_EQ(::utimes(reused.c_str(), times), 0);
  detail::remove_stale_session_dirs();
  EXPECT_FALSE(fs::exists(reused));
}

}  // namespace
}  // namespace hpctrial::launcher
